"""Validation loss and perplexity: the exact chunked loss, no gradient, in fixed order."""

from __future__ import annotations

import math

import torch

from mesp.batch import Example
from mesp.data.batches import iter_eval_batches
from mesp.errors import MespError
from mesp.models.transformer import CausalLM
from mesp.ops.cross_entropy import chunked_ce_loss
from mesp.training.distributed import DataParallel

EVAL_VOCAB_CHUNK = 16384  # head slices of this many rows: Gemma's 262k vocabulary stays small


@torch.no_grad()
def evaluate(
    model: CausalLM,
    examples: list[Example],
    batch_size: int,
    pad_id: int,
    max_batches: int = 0,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """Mean token loss and perplexity; the loss never forms full logits (chunked CE). With
    `dp`, every rank scores its share of the batches and the sums are all-reduced (all ranks
    must call it): no rank waits out the others' evaluation in a collective."""
    total, n = 0.0, 0
    dev = model.device
    for i, batch in enumerate(iter_eval_batches(examples, batch_size, pad_id=pad_id)):
        if max_batches and i >= max_batches:
            break
        if dp is not None and i % dp.world != dp.rank:
            continue
        batch = batch.to(dev)
        loss, k = chunked_ce_loss(
            model.hidden(batch.input_ids),
            batch.targets,
            batch.mask,
            model.head_weight(),
            model.config.final_logit_softcapping,
            chunk_rows=512,
            vocab_chunk=EVAL_VOCAB_CHUNK,
        )
        total += float(loss)
        n += k
    if dp is not None:
        total, n_sum = dp.sum_scalars([total, float(n)])
        n = int(n_sum)
    if n == 0:
        raise MespError("validation set has no trained tokens")
    loss = total / n
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": n}
