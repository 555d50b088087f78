"""Preference objectives (DPO, ORPO) on any exact engine: only the loss head changes.

A preference batch holds pairs as consecutive rows: row 2i is pair i's chosen sequence, row
2i+1 its rejected one; mask marks the completion tokens (the only ones that count). With lp_b
the summed log-probability of row b's completion tokens, the pair loss depends on the
parameters only through the lp_b, so

    dL/dθ = Σ_b dL/dlp_b · dlp_b/dθ = Σ_b Σ_{t in b} (−dL/dlp_b) · dCE_t/dθ      (lp = −Σ CE)

is the gradient of a *weighted token cross-entropy* whose weight on row b's tokens is the scalar
−dL/dlp_b. So `PreferenceEngine.step` runs:
  1. the reference log-probs: the same model with every adapter's scale set to 0 (the base,
     no second copy), no tape; or, with --ref-cache, read per row from disk (ref_cache.py);
  2. the policy log-probs, no tape;
  3. the pair loss and its derivative wrt each row's lp (B scalars);
  4. the wrapped engine's ordinary SFT step on the batch with those per-token weights.
The block backward (bp's autograd, mebp's recompute, mesp's hand backward) is SFT's. The policy
forward runs twice (step 2 without a tape, step 4 in training); that costs one forward and is
exact: step 4's forward computes the same lp that the weights were derived from.

Formulas are TRL's (trl/trainer/dpo_trainer.py, orpo_trainer.py):
  DPO, loss_type "sigmoid":  logits = (π_c − π_r) − (ref_c − ref_r),  π = summed completion
      log-probs;  loss = −logsigmoid(β·logits), mean over pairs;  rewards β(π − ref).
  ORPO:  π = mean completion log-probs;  log_odds = (π_c − π_r) − (log1p(−e^π_c) −
      log1p(−e^π_r));  loss = NLL − λ·mean(logsigmoid(log_odds)), NLL the mean cross-entropy
      over the batch's chosen completion tokens;  rewards λ·π.
Each micro-batch's loss is its pairs' mean (TRL's per-device batch); accumulated micro-batches
average (`batch_mean`: the training loop's normalizer is the number of micro-batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.batch import Batch
from mesp.engines.ref_cache import RefCache, row_keys
from mesp.errors import MespError
from mesp.models.transformer import CausalLM
from mesp.ops.cross_entropy import CEOptions, chunked_ce_row_losses

OBJECTIVES = ("sft", "dpo", "orpo")
LOSS_TYPES = ("sigmoid",)


@dataclass(frozen=True)
class Objective:
    kind: str = "sft"
    beta: float = 0.1
    orpo_lambda: float = 0.1
    loss_type: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            choices = ", ".join(OBJECTIVES)
            raise MespError(f"--objective must be one of {choices}, got {self.kind!r}")
        if self.loss_type not in LOSS_TYPES:
            raise MespError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}")
        if not self.beta > 0 or not self.orpo_lambda >= 0:
            raise MespError("--beta must be positive and --orpo-lambda 0 or more")

    @property
    def preference(self) -> bool:
        return self.kind != "sft"


@contextmanager
def adapters_off(model: CausalLM) -> Iterator[None]:
    """The base model: every adapter's scale 0 for the duration (y = xWᵀ + 0·(xAᵀ)Bᵀ = xWᵀ,
    exactly: the LoRA term is an exact zero)."""
    mods = list(model.lora_modules().values())
    scales = [m.lora_scale for m in mods]
    try:
        for m in mods:
            m.lora_scale = 0.0
        yield
    finally:
        for m, s in zip(mods, scales, strict=True):
            m.lora_scale = s


@torch.no_grad()
def sequence_logps(model: CausalLM, batch: Batch, opts: CEOptions | None = None) -> Tensor:
    """(B,) fp64: each row's summed log-probability of its trained (mask) tokens, no tape.
    One chunked CE pass over the final-normed states: no full logits."""
    hn = model.hidden(batch.input_ids)
    head, cap = model.head_weight(), model.config.final_logit_softcapping
    o = opts or CEOptions(512, 16384)
    rows = chunked_ce_row_losses(hn, batch.targets, batch.mask, head, cap, o)
    # summed in fp64 in position order, as the chunked CE sums its rows
    return -rows.view(batch.mask.shape).to(torch.float64).sum(1).cpu()


def pair_terms(
    obj: Objective, lp: Tensor, ref: Tensor | None, n_tok: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch loss (0-d) from per-row summed completion log-probs lp (B,), the
    reference's `ref` (B,) (DPO) and the rows' completion token counts, and per-pair
    (chosen_reward, rejected_reward, nll_sum, chosen_tokens) for metrics."""
    c, r = lp[0::2], lp[1::2]
    if obj.kind == "dpo":
        assert ref is not None
        logits = (c - r) - (ref[0::2] - ref[1::2])
        losses = -F.logsigmoid(obj.beta * logits)  # TRL loss_type "sigmoid", label_smoothing 0
        loss = losses.mean()
        rc, rr = obj.beta * (c - ref[0::2]), obj.beta * (r - ref[1::2])
    else:  # orpo
        nc, nr = n_tok[0::2], n_tok[1::2]
        mc, mr = c / nc, r / nr  # mean log-probs (TRL: average_log_prob=True)
        log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
        ratio = F.logsigmoid(log_odds)
        nll = -c.sum() / nc.sum()  # CrossEntropyLoss over every chosen completion token
        loss = nll - obj.orpo_lambda * ratio.mean()
        rc, rr = obj.orpo_lambda * mc, obj.orpo_lambda * mr
    stats = {"chosen": rc.detach(), "rejected": rr.detach(), "nll": -c.detach(), "n": n_tok[0::2]}
    return loss, stats


def check_pairs(batch: Batch) -> Tensor:
    """(B,) completion token counts; refuses an odd batch or a row with no completion token."""
    n = batch.mask.sum(1).to(torch.float64).cpu()
    if batch.mask.shape[0] % 2:
        raise MespError("a preference batch holds (chosen, rejected) pairs: an even row count")
    if bool((n == 0).any()):
        raise MespError("a preference row has no completion token")
    return n


def reference_logps(
    model: CausalLM, batch: Batch, opts: CEOptions | None = None, cache: RefCache | None = None
) -> Tensor:
    """(B,) fp64: the base model's (adapters off) summed completion log-probs, no tape; from
    `cache` where every row is there (the first such batch of a process is also recomputed
    and checked against it), written to it otherwise."""
    keys = row_keys(batch) if cache is not None else []
    got = cache.lookup(keys) if cache is not None else None
    if got is not None and cache is not None and cache.verified:
        return got
    with adapters_off(model):
        ref = sequence_logps(model, batch, opts)
    if cache is not None:
        if got is not None:
            cache.verify(got, ref)
            return got  # the cached bits, as every later epoch and resume reads them
        cache.store(keys, ref)
    return ref


def preference_weights(
    model: CausalLM,
    batch: Batch,
    obj: Objective,
    opts: CEOptions | None = None,
    ref_cache: RefCache | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(per-token weights (B, S), micro-batch loss, stats): the reference pass first (no
    tape, adapters off; or `ref_cache`'s values), then the policy's (no tape); dL/dlp by
    autograd over the B scalars (exact; for DPO it is −β·σ(−β·logits) for the chosen row and
    the opposite for the rejected)."""
    n = check_pairs(batch)
    ref = None
    if obj.kind == "dpo":
        ref = reference_logps(model, batch, opts, ref_cache)
    lp = sequence_logps(model, batch, opts).requires_grad_()
    with torch.enable_grad():
        loss, stats = pair_terms(obj, lp, ref, n)
        (g,) = torch.autograd.grad(loss, lp)
    w = (-g).to(torch.float32)[:, None] * batch.mask.float().cpu()
    return w.to(batch.mask.device), loss.detach(), stats


class PreferenceEngine:
    """Any exact engine (bp, mebp, mesp) trained on a preference objective: the inner engine
    takes the per-token weights; its block backward is the one SFT uses."""

    batch_mean = True  # step returns the micro-batch's mean pair loss; the loop averages them

    def __init__(self, inner: Any, objective: Objective) -> None:  # an Engine (no cycle)
        if inner.name == "mezo":
            raise MespError(
                f"--objective {objective.kind} needs a gradient engine (bp, mebp, mesp); "
                "mezo is not supported"
            )
        loss = getattr(inner, "loss", None)
        if loss is not None and loss.kind != "ce":
            raise MespError(f"--objective {objective.kind} needs the exact loss (--loss ce)")
        self.inner, self.objective, self.name = inner, objective, inner.name
        self.loss = loss
        # --ref-cache: set by the trainer, not an engine option, so it stays out of the resume
        # fingerprint (cached values are the reference's, within RefCache.AGREE)
        self.ref_cache: RefCache | None = None

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        w, loss, _ = preference_weights(model, batch, self.objective, None, self.ref_cache)
        self.inner.step(model, replace(batch, weights=w), normalizer)
        return float(loss)

    def __getattr__(self, name: str) -> object:  # attach, state_dict, … of the inner engine
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
