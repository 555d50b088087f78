"""Validation loss and perplexity: the exact chunked loss, no gradient, in fixed order."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from mesp.batch import Example
from mesp.data import DataConfig, load_splits, pad_id_of
from mesp.data.batches import iter_eval_batches
from mesp.errors import MespError
from mesp.loading.session import ModelOptions, open_with_adapter
from mesp.models.transformer import CausalLM
from mesp.ops.cross_entropy import chunked_ce_loss
from mesp.training.distributed import DataParallel


@dataclass
class EvalOptions:
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter directory"})
    batch_size: int = field(default=4, metadata={"help": "sequences per batch"})
    max_batches: int = field(default=0, metadata={"help": "batches to score (0 = all)"})
    json: bool = field(default=False, metadata={"help": "print one JSON object"})


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


def score(opts: ModelOptions, ev: EvalOptions, data: DataConfig) -> dict[str, float]:
    """`mesp eval`: loss and perplexity of the model (+ adapter) on a file (all of it) or a
    directory or the built-in set (its validation split), with the seconds it took."""
    data, whole = data.for_scoring()
    loaded = open_with_adapter(opts, ev.adapter)
    tok, cfg = loaded.tokenizer, loaded.model.config  # pre-tokenized rows need no tokenizer
    data.check_positions(cfg.max_position_embeddings)
    splits = load_splits(data, tok, vocab_size=cfg.vocab_size)
    rows = splits["train"] if whole else splits["valid"]
    t0 = time.perf_counter()
    res = evaluate(loaded.model, rows, ev.batch_size, pad_id_of(tok, cfg), ev.max_batches)
    res["seconds"] = time.perf_counter() - t0
    return res
