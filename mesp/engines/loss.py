"""The training objective every engine differentiates: summed token cross-entropy over
trained (mask=True) targets. Engines divide by the group's token count themselves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100


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
