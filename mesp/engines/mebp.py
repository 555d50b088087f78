"""mebp: gradient checkpointing at block boundaries with an autograd recompute per block (MeBP).

Forward runs without autograd and keeps only each block's input. Backward walks the blocks in
reverse: re-run one block with autograd from its checkpoint, backpropagate the incoming gradient
through it, and drop everything but the gradient of its input. An explicit loop, no hooks.
"""

from __future__ import annotations

import torch

from mesp.batch import Batch
from mesp.engines.loss import LossSpec, autograd_loss_sum, loss_value
from mesp.engines.offload import CheckpointStore
from mesp.models.transformer import CausalLM


class MeBPEngine:
    name = "mebp"
    clipper = None  # DP-SGD (private.py): told when each block's gradients are complete

    def __init__(
        self,
        offload: str = "none",
        offload_dir: str | None = None,
        offload_fallback: bool = False,
        loss: LossSpec | None = None,
    ) -> None:
        self.offload = (offload, offload_dir, offload_fallback)
        self.loss = loss or LossSpec()

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        with CheckpointStore(*self.offload) as store:
            return self._step(model, batch, normalizer, store)

    def _step(
        self, model: CausalLM, batch: Batch, normalizer: int, store: CheckpointStore
    ) -> float:
        ids = batch.input_ids
        ctx = model.context(ids.shape[1], ids.device)
        with torch.no_grad():
            h = model.embed(ids)
            for i, block in enumerate(model.layers):
                store.put(i, h)  # the block's input: all that survives the forward
                h = block(h, ctx)
        # The head and loss run with autograd from the last block's output.
        h = h.requires_grad_()
        loss = autograd_loss_sum(model, model.final_norm(h), batch, self.loss)
        (loss / normalizer).backward()
        g = h.grad
        del h
        store.prefetch(len(model.layers) - 1)
        for i in range(len(model.layers) - 1, -1, -1):
            x = store.pop(i).requires_grad_(i > 0)  # block 0's input needs no gradient
            store.prefetch(i - 1)
            with torch.enable_grad():
                y = model.layers[i](x, ctx)
            y.backward(g)
            g = x.grad
            del x, y
            if self.clipper is not None:
                self.clipper.block_done()
        return loss_value(loss)
