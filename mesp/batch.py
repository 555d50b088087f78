"""Examples and batches: what an engine steps on.

An `Example` is a token sequence plus a per-token 0/1 mask; mask[i] = 1 means token i is a
trained *target* (predicted from tokens < i), so mask[0] is always 0. A batch shifts by one:
inputs = ids[:-1], targets = ids[1:], and the loss mask is mask[1:]. Packing and the resumable
stream that produce them live in the data wing (`mesp.data.batches`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mesp.errors import MespError


@dataclass
class Example:
    """One training row: `ids` (token ids) and `mask` (1 = token is a trained target)."""

    ids: list[int]
    mask: list[int]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.mask):
            raise ValueError(f"Example: {len(self.ids)} ids but {len(self.mask)} mask entries")

    @property
    def n_targets(self) -> int:
        """Trained tokens; position 0 never counts since nothing predicts it."""
        return sum(self.mask[1:])


@dataclass
class Batch:
    """Right-padded (B, S) tensors; S is the longest row in this batch minus one.

    `mask` is authoritative: padded positions hold the pad id in both `input_ids` and
    `targets` and are False in `mask`.
    """

    input_ids: torch.Tensor  # LongTensor (B, S)
    targets: torch.Tensor  # LongTensor (B, S)
    mask: torch.Tensor  # BoolTensor (B, S)
    # per-token loss weights (B, S) or None (all 1): a preference objective's loss head puts
    # d loss / d(sequence log-prob) here, so the engines' backward is SFT's (engines/objective.py)
    weights: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        """Number of trained target tokens, for per-token loss averaging and throughput."""
        return int(self.mask.sum().item())

    def to(self, device: torch.device | str) -> Batch:
        w = None if self.weights is None else self.weights.to(device)
        return Batch(self.input_ids.to(device), self.targets.to(device), self.mask.to(device), w)


def collate(examples: Sequence[Example], pad_id: int = 0) -> Batch:
    """Stack examples into one right-padded batch, shifted for next-token prediction."""
    if not examples:
        raise MespError("cannot build a batch from no examples")
    width = max(max(len(e.ids) - 1 for e in examples), 1)
    n = len(examples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    targets = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    for r, e in enumerate(examples):
        k = len(e.ids) - 1
        if k <= 0:
            continue
        input_ids[r, :k] = torch.tensor(e.ids[:-1], dtype=torch.long)
        targets[r, :k] = torch.tensor(e.ids[1:], dtype=torch.long)
        mask[r, :k] = torch.tensor(e.mask[1:], dtype=torch.bool)
    return Batch(input_ids, targets, mask)


def keep_last_fraction(batch: Batch, fraction: float) -> Batch:
    """Logits masking: train only the last `fraction` of each row's trained targets (the
    Qualcomm ladder trains 30% of positions). Engines that form logits only for trained rows
    (mesp's chunked CE) then spend loss memory and time in proportion to `fraction`."""
    if fraction >= 1.0:
        return batch
    counts = batch.mask.sum(1, keepdim=True)  # (B, 1) trained targets per row
    keep = torch.ceil(counts * fraction).long()
    rank = batch.mask.long().flip(1).cumsum(1).flip(1)  # position's rank counted from the end
    return Batch(batch.input_ids, batch.targets, batch.mask & (rank <= keep))
