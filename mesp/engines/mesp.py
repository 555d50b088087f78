"""mesp: structured backpropagation (MeSP) with hand-derived block backward.

Forward keeps only block inputs (checkpoints). The loss is a chunked cross-entropy that returns
d(final hidden) without full logits. Backward walks blocks in reverse: one no-grad recompute of
the block records on a tape exactly what the hand backward needs, then the hand backward pops
each tensor at its last use. LoRA's h = x Aᵀ is recomputed from x (or stored, `h_strategy`).
Budget-aware recompute (`keep_tapes`, chosen by the planner from --max-memory): the last k
blocks record their tape during the forward instead, and their backward uses it as it is.
The block backward and the kept forward are in mesp_block.py.

What each block keeps on the tape, and why (S tokens, F intermediate, H·D attention width):
  n1, n2      inputs of the q/k/v and gate/up LoRA linears (their dA needs x)       S×hidden
  q, k, v, o, lse   the flash-attention backward (no S×S matrix ever)               S×H·D
  q_lin, k_lin      inputs of the q/k norms (Qwen3, Gemma3)                         S×H·D
  gate, up    the gated activation's backward; act(gate)·up (down's input) is recomputed
  x2          input of the second norm                                              S×hidden
  a, d        inputs of Gemma3's post-attention / post-MLP norms                    S×hidden
"""

from __future__ import annotations

import torch

from mesp.batch import Batch
from mesp.engines.loss import LossSpec, loss_value
from mesp.engines.mesp_block import H_STRATEGIES, block_backward, kept_forward, norm_bwd
from mesp.engines.offload import CheckpointStore
from mesp.engines.weight_stream import BlockWeightStream
from mesp.errors import MespError
from mesp.models.transformer import CausalLM, Tape
from mesp.ops.cross_entropy import chunked_ce_loss_and_grad


class MeSPEngine:
    name = "mesp"
    clipper = None  # DP-SGD (private.py): told when each block's gradients are complete

    def __init__(
        self,
        h_strategy: str = "recompute",
        chunk_rows: int | None = 512,
        vocab_chunk: int | None = 8192,
        offload: str = "none",
        offload_dir: str | None = None,
        offload_fallback: bool = False,
        loss: LossSpec | None = None,
        stream_weights: bool = False,
        keep_tapes: int = 0,
    ) -> None:
        """keep_tapes: the last this many blocks record their tape in the forward and skip the
        recompute (budget-aware recompute: the planner picks it from --max-memory); the
        gradients are the same bits. stream_weights: frozen block weights live on disk (in
        offload_dir), one or two blocks resident at a time (see weight_stream). chunk_rows
        None: all trained rows in one logits block; vocab_chunk 0 or None: the head in one
        piece (with chunk_rows None, the full-logits baseline of the ladder)."""
        if h_strategy not in H_STRATEGIES:
            raise MespError(f"--h-strategy must be one of {', '.join(H_STRATEGIES)}")
        self.store_h = h_strategy == "store"
        self.chunk_rows, self.vocab_chunk = chunk_rows, vocab_chunk
        self.offload = (offload, offload_dir, offload_fallback)
        self.loss = loss or LossSpec()
        self.stream_weights, self._stream = stream_weights, None
        if keep_tapes < 0:
            raise MespError(f"keep_tapes must be 0 or more, got {keep_tapes}")
        self.keep_tapes = keep_tapes

    def attach(self, model: CausalLM) -> BlockWeightStream | None:
        """Start streaming `model`'s block weights (once per model) when asked to."""
        if not self.stream_weights:
            return None
        if self._stream is None or self._stream.model is not model:
            if self._stream is not None:
                self._stream.close()
            self._stream = BlockWeightStream(model, self.offload[1])
        return self._stream

    @torch.no_grad()
    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        with CheckpointStore(*self.offload) as store:
            return self._run(model, batch, normalizer, store)

    def _run(self, model: CausalLM, batch: Batch, normalizer: int, store: CheckpointStore) -> float:
        ids = batch.input_ids
        ctx = model.context(ids.shape[1], ids.device)
        ws = self.attach(model)
        h = model.embed(ids)
        n_layers = len(model.layers)
        first_kept = n_layers - min(self.keep_tapes, n_layers)
        tapes: dict[int, Tape] = {}  # the kept blocks' tapes, each freed by its backward
        for i, block in enumerate(model.layers):
            # block input: the only activation kept across blocks (a kept block's backward
            # still needs it, for the first norm's)
            store.put(i, h)
            if ws is not None:
                ws.prefetch(i)  # (a no-op when block i was prefetched already)
                ws.prefetch(i + 1)
            if i >= first_kept:
                h, tapes[i] = kept_forward(block, h, ctx)
            else:
                h = block(h, ctx)
        store.prefetch(n_layers - 1)  # read the last checkpoint back while the loss runs
        norm = model.model.norm
        hn = norm(h)
        self.loss.check(model.config.vocab_size)
        loss, _, dhn = chunked_ce_loss_and_grad(
            hn,
            batch.targets,
            batch.mask,
            model.head_weight(),
            model.config.final_logit_softcapping,
            normalizer=normalizer,
            opts=self.loss.ce_options(self.chunk_rows, self.vocab_chunk),
            weights=batch.weights,
        )
        del hn
        g = norm_bwd(dhn, h, norm)
        del dhn, h
        for i in range(n_layers - 1, -1, -1):
            x = store.pop(i)
            store.prefetch(i - 1)
            if ws is not None:
                ws.pin(i)  # resident through the recompute and the hand backward
                ws.prefetch(i - 1)
            g = block_backward(
                model.layers[i], x, ctx, g, i > 0, self.store_h, tape=tapes.pop(i, None)
            )
            del x
            if self.clipper is not None:
                self.clipper.block_done()
            if ws is not None:
                ws.unpin(i)
        return loss_value(loss)
