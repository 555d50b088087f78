"""mebp: gradient checkpointing at block boundaries with an autograd recompute per block (MeBP).

Forward runs without autograd and keeps only each block's input. Backward walks the blocks in
reverse: re-run one block with autograd from its checkpoint, backpropagate the incoming gradient
through it, and drop everything but the gradient of its input. An explicit loop, no hooks.
"""

from __future__ import annotations

import torch

from mesp.data_batches import Batch
from mesp.engines.loss import ce_sum
from mesp.models.transformer import CausalLM


class MeBPEngine:
    name = "mebp"

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        ids = batch.input_ids
        ctx = model.context(ids.shape[1], ids.device)
        checkpoints = []
        with torch.no_grad():
            h = model.embed(ids)
            for block in model.layers:
                checkpoints.append(h)  # the block's input: all that survives the forward
                h = block(h, ctx)
        # The head and loss run with autograd from the last block's output.
        h = h.requires_grad_()
        loss = ce_sum(model.logits(model.final_norm(h)), batch.targets, batch.mask)
        (loss / normalizer).backward()
        g = h.grad
        del h
        for i in range(len(model.layers) - 1, -1, -1):
            x = checkpoints.pop().requires_grad_(i > 0)  # block 0's input needs no gradient
            with torch.enable_grad():
                y = model.layers[i](x, ctx)
            y.backward(g)
            g = x.grad
            del x, y
        return loss.item()
