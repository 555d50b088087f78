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
  DPO:  logits = (π_c − π_r) − (ref_c − ref_r),  π = summed completion log-probs (mean ones
      for "ipo", policy and reference alike, as TRL's concatenated_forward divides them);
      rewards β(π − ref);  per pair, with ε the label smoothing and a/b = π_c − ref_c / π_r − ref_r,
        sigmoid   −(1−ε)·logσ(β·logits) − ε·logσ(−β·logits)          (TRL's default)
        robust    (−(1−ε)·logσ(β·logits) + ε·logσ(−β·logits)) / (1 − 2ε)
        exo_pair  σ(β·logits)(logσ(β·logits) − log(1−ε)) + σ(−β·logits)(logσ(−β·logits) − log ε),
                  ε = 1e-3 where it is 0 (as TRL sets it)
        hinge     relu(1 − β·logits)
        ipo       (logits − 1/(2β))²
        nca_pair  −logσ(βa) − ½·logσ(−βa) − ½·logσ(−βb)
        sppo_hard (a − 1/(2β))² + (b + 1/(2β))²
        apo_zero  1 − σ(βa) + σ(βb)
        apo_down  σ(βa) + 1 − σ(β(a − b))
      the pair losses' mean.
  ORPO:  π = mean completion log-probs;  log_odds = (π_c − π_r) − (log1p(−e^π_c) −
      log1p(−e^π_r));  loss = NLL − λ·mean(logsigmoid(log_odds)), NLL the mean cross-entropy
      over the batch's chosen completion tokens;  rewards λ·π.
Each micro-batch's loss is its pairs' mean (TRL's per-device batch); accumulated micro-batches
average (`batch_mean`: the training loop's normalizer is the number of micro-batches).
"""

from __future__ import annotations

import math
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
LOSS_TYPES = (
    "sigmoid", "robust", "exo_pair", "hinge", "ipo", "nca_pair", "sppo_hard", "apo_zero", "apo_down"
)  # fmt: skip
SMOOTHED = ("sigmoid", "robust", "exo_pair")  # the loss types --label-smoothing enters


@dataclass(frozen=True)
class Objective:
    kind: str = "sft"
    beta: float = 0.1
    orpo_lambda: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            choices = ", ".join(OBJECTIVES)
            raise MespError(f"--objective must be one of {choices}, got {self.kind!r}")
        if self.loss_type not in LOSS_TYPES:
            raise MespError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}")
        if not self.beta > 0 or not self.orpo_lambda >= 0:
            raise MespError("--beta must be positive and --orpo-lambda 0 or more")
        if self.kind != "dpo" and (self.loss_type != "sigmoid" or self.label_smoothing):
            raise MespError("--loss-type and --label-smoothing are DPO's: needs --objective dpo")
        if not 0 <= self.label_smoothing < 0.5:
            raise MespError("--label-smoothing must be in [0, 0.5)")
        if self.label_smoothing and self.loss_type not in SMOOTHED:
            raise MespError(f"--label-smoothing applies to --loss-type {', '.join(SMOOTHED)}")

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
        if obj.loss_type == "ipo":  # mean log-probs, the reference's too
            c, r, ref = c / n_tok[0::2], r / n_tok[1::2], ref / n_tok
        a, b = c - ref[0::2], r - ref[1::2]
        loss = dpo_pair_losses(obj, a, b).mean()
        rc, rr = obj.beta * a, obj.beta * b
    else:  # orpo
        nc, nr = n_tok[0::2], n_tok[1::2]
        mc, mr = c / nc, r / nr  # mean log-probs (TRL: average_log_prob=True)
        log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
        ratio = F.logsigmoid(log_odds)
        nll = -c.sum() / nc.sum()  # CrossEntropyLoss over every chosen completion token
        loss = nll - obj.orpo_lambda * ratio.mean()
        rc, rr = obj.orpo_lambda * mc, obj.orpo_lambda * mr
    nll = -lp[0::2].detach()  # summed: the chosen completions' NLL whatever the loss type
    stats = {"chosen": rc.detach(), "rejected": rr.detach(), "nll": nll, "n": n_tok[0::2]}
    return loss, stats


def dpo_pair_losses(obj: Objective, a: Tensor, b: Tensor) -> Tensor:
    """(P,) DPO pair losses of the chosen / rejected log-ratios a = π_c − ref_c, b = π_r − ref_r
    (TRL's DPOTrainer.dpo_loss; the table in the module docstring)."""
    beta, eps, t = obj.beta, obj.label_smoothing, obj.loss_type
    z = beta * (a - b)  # β·logits
    if t == "sigmoid":
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if t == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if t == "exo_pair":
        eps = eps or 1e-3
        pos = torch.sigmoid(z) * (F.logsigmoid(z) - math.log(1 - eps))
        return pos + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))
    if t == "hinge":
        return torch.relu(1 - z)
    if t == "ipo":
        return (a - b - 1 / (2 * beta)) ** 2
    if t == "nca_pair":
        ca, cb = beta * a, beta * b
        return -F.logsigmoid(ca) - 0.5 * F.logsigmoid(-ca) - 0.5 * F.logsigmoid(-cb)
    if t == "sppo_hard":
        return (a - 0.5 / beta) ** 2 + (b + 0.5 / beta) ** 2
    if t == "apo_zero":
        return 1 - torch.sigmoid(beta * a) + torch.sigmoid(beta * b)
    assert t == "apo_down", t
    return torch.sigmoid(beta * a) + 1 - torch.sigmoid(z)


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
