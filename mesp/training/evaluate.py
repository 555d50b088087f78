"""Validation loss and perplexity: the exact chunked loss, no gradient, in fixed order."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from mesp.batch import Example
from mesp.data import DataConfig, load_splits, pad_id_of
from mesp.data.batches import iter_eval_batches
from mesp.data.preference import Pair, iter_pair_batches
from mesp.engines.objective import (
    Objective,
    check_pairs,
    pair_terms,
    reference_logps,
    sequence_logps,
)
from mesp.engines.ref_cache import RefCache
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
    objective: Objective | None = None,
    ref_cache: RefCache | None = None,
) -> dict[str, float]:
    """Mean token loss and perplexity; the loss never forms full logits (chunked CE). With
    `dp`, every rank scores its share of the batches and the sums are all-reduced (all ranks
    must call it): no rank waits out the others' evaluation in a collective. A preference
    `objective` scores pairs instead (`evaluate_pairs`; DPO's reference from `ref_cache`
    where it holds the rows)."""
    if objective is not None and objective.preference:
        if dp is not None:
            raise MespError("preference objectives run in one process (no --nproc)")
        return evaluate_pairs(
            model, examples, batch_size, pad_id, objective, max_batches, ref_cache
        )  # type: ignore[arg-type]
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


@torch.no_grad()
def evaluate_pairs(
    model: CausalLM,
    pairs: list[Pair],
    batch_size: int,
    pad_id: int,
    objective: Objective,
    max_batches: int = 0,
    ref_cache: RefCache | None = None,
) -> dict[str, float]:
    """The objective's loss over all scored pairs (as one batch: the pairs' mean, ORPO's NLL
    over all chosen tokens), the preference accuracy (the chosen reward above the rejected),
    the mean reward margin (TRL's rewards/accuracies, rewards/margins), and the perplexity of
    the chosen completions."""
    lps, refs, ns = [], [], []
    dev = model.device
    for i, batch in enumerate(iter_pair_batches(pairs, batch_size, pad_id)):
        if max_batches and i >= max_batches:
            break
        batch = batch.to(dev)
        ns.append(check_pairs(batch))
        if objective.kind == "dpo":
            refs.append(reference_logps(model, batch, None, ref_cache))
        lps.append(sequence_logps(model, batch))
    if not lps:
        raise MespError("validation set has no pairs")
    ref = torch.cat(refs) if refs else None
    n = torch.cat(ns)
    loss, st = pair_terms(objective, torch.cat(lps), ref, n)
    margin = st["chosen"] - st["rejected"]
    nll = float(st["nll"].sum() / st["n"].sum())
    return {
        "loss": float(loss),
        "ppl": math.exp(min(nll, 50.0)),
        "accuracy": float((margin > 0).double().mean()),
        "margin": float(margin.mean()),
        "pairs": int(margin.numel()),
        "tokens": int(n.sum()),
    }


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
