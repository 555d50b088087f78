"""The training objective every engine differentiates: summed token cross-entropy over
trained (mask=True) targets. Engines divide by the group's token count themselves.

`LossSpec` says how the loss head runs, for every engine alike: logits masking (logits only
for trained rows, on by default: the gradient is the same, the memory and time scale with the
trained tokens) and the optional approximate softmax over a vocabulary subset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.batch import Batch
from mesp.errors import MespError
from mesp.models.transformer import CausalLM
from mesp.ops.cross_entropy import CEOptions
from mesp.ops.matmul import linear
from mesp.ops.sampled_softmax import check_subset, choose_subset, subset_head

IGNORE = -100
LOSSES = ("ce", "sampled-softmax")


@dataclass(frozen=True)
class LossSpec:
    """kind 'ce' (exact) or 'sampled-softmax' (targets + `vocab_subset` proxy-chosen tokens);
    `mask_logits` False forms logits for untrained rows too (the ablation baseline)."""

    kind: str = "ce"
    vocab_subset: int = 1000
    mask_logits: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise MespError(f"--loss must be one of {', '.join(LOSSES)}, got {self.kind!r}")
        if self.kind == "sampled-softmax" and (
            type(self.vocab_subset) is not int or self.vocab_subset < 1
        ):
            raise MespError(f"--vocab-subset must be a positive integer, got {self.vocab_subset!r}")

    @property
    def subset(self) -> int | None:
        return self.vocab_subset if self.kind == "sampled-softmax" else None

    def check(self, vocab: int) -> None:
        """Errors that need the model: K must be below the vocabulary size."""
        if self.subset is not None:
            check_subset(self.subset, vocab)

    def ce_options(self, chunk_rows: int | None, vocab_chunk: int | None) -> CEOptions:
        return CEOptions(chunk_rows, vocab_chunk, self.mask_logits, self.subset, self.seed)


def masked_targets(targets: Tensor, mask: Tensor) -> Tensor:
    """targets with untrained positions set to the ignore index."""
    return torch.where(mask, targets, torch.full_like(targets, IGNORE))


def ce_sum(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """logits (B, S, V), targets/mask (B, S) -> scalar fp32 sum of token losses (full logits)."""
    v = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, v).float(),
        masked_targets(targets, mask).reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def autograd_loss_sum(
    model: CausalLM, hn: Tensor, batch: Batch, spec: LossSpec, vocab_chunk: int = 8192
) -> Tensor:
    """bp/mebp/mezo: head + loss from final-normed states hn (B, S, D), under autograd when hn
    requires grad. Logits exist for the trained rows only when spec.mask_logits."""
    spec.check(model.config.vocab_size)
    if not bool(batch.mask.any()):  # nothing trained: a zero loss, zero gradients, no NaN
        return hn.sum().float() * 0.0
    # ids / targets are found where the batch lives (the host, for meta-device models)
    mask, dev = batch.mask.reshape(-1), hn.device
    tgt = masked_targets(batch.targets, batch.mask).reshape(-1)
    hs = hn.reshape(-1, hn.shape[-1])
    ids = mask.nonzero().squeeze(1)
    if spec.mask_logits:
        hs, tgt = hs.index_select(0, ids.to(dev)), tgt.index_select(0, ids)
        ids = torch.arange(ids.numel())
    if spec.subset is None:
        z = model.logits(hs)  # (rows, V)
    else:
        head, host_tgt = model.head_weight(), tgt.index_select(0, ids)
        trained = hs.detach().index_select(0, ids.to(dev))
        subset, bias = choose_subset(trained, host_tgt, head, spec.subset, spec.seed, vocab_chunk)
        del trained
        w, local = subset_head(head, subset, tgt.clamp(min=0), hs.dtype)
        tgt = torch.where(tgt.to(dev) != IGNORE, local, IGNORE)
        z = linear(hs, w)  # (rows, |S|)
        cap = model.config.final_logit_softcapping
        z = (torch.tanh(z / cap) * cap if cap else z) + bias
    # per-row losses in fp32, their sum in fp64 (as the chunked CE): the reported loss then
    # does not depend on how rows are grouped; gradients are those of the fp32 row losses
    rows = F.cross_entropy(z.float(), tgt.to(dev), ignore_index=IGNORE, reduction="none")
    if batch.weights is not None:  # a preference objective's per-token weights (objective.py)
        w = batch.weights.reshape(-1).to(device=dev, dtype=rows.dtype)
        rows = rows * (w[batch.mask.reshape(-1).to(dev)] if spec.mask_logits else w)
    return rows.sum(dtype=torch.float64)


def loss_value(loss: Tensor) -> float:
    """The summed loss as a float; NaN on the meta device (memory accounting has no values)."""
    return float("nan") if loss.is_meta else loss.item()
