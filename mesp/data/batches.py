"""Packing and batching: examples -> fixed-size rows -> the resumable, shuffled batch stream."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mesp.batch import Batch, Example, collate
from mesp.errors import MespError


def chunk_examples(
    examples: Sequence[Example], seq_len: int, bos_id: int | None = None
) -> list[Example]:
    """Concatenate examples and cut the stream into rows of seq_len + 1 tokens.

    Consecutive rows overlap by one token (row k's last token is row k+1's first input), so
    every token of the stream is a target in exactly one row. This is packing: attention is
    not reset at example boundaries (examples are separated only by their EOS), as with
    mlx-lm or HF packing without position resets. Rows with no trained target are dropped.

    With `bos_id` (models whose tokenizer adds BOS, e.g. Gemma: without it at position 0 their
    perplexity is several times worse) every row is BOS + the next seq_len stream tokens, so
    again every stream token is a target in exactly one row.
    """
    if seq_len < 1:
        raise MespError(f"--seq-len must be at least 1, got {seq_len}")
    ids: list[int] = []
    mask: list[int] = []
    for e in examples:
        ids.extend(e.ids)
        mask.extend(e.mask)
    rows: list[Example] = []
    start = 0
    while start + 1 < len(ids):
        if bos_id is not None and ids[start] != bos_id:
            end = min(start + seq_len, len(ids))
            row = Example([bos_id, *ids[start:end]], [0, *mask[start:end]])
            nxt = end
        else:
            end = min(start + seq_len + 1, len(ids))
            row = Example(ids[start:end], [0, *mask[start + 1 : end]])
            nxt = start + seq_len if bos_id is None else end  # (a BOS row needs no overlap)
        if row.n_targets:
            rows.append(row)
        start = nxt
    return rows


class BatchStream:
    """An endless, deterministic, resumable stream of shuffled training batches.

    Epoch e visits the examples in the order torch.randperm(n, Generator(seed + e)), in
    consecutive batches of `batch_size` (the last batch of an epoch may be smaller). The
    position is two integers, so a checkpointed run resumes onto exactly the same batches.
    """

    def __init__(
        self, examples: Sequence[Example], batch_size: int, seed: int = 0, pad_id: int = 0
    ) -> None:
        if not examples:
            raise MespError("no training examples to batch")
        if batch_size < 1:
            raise MespError(f"--batch-size must be at least 1, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.epoch = 0
        self.index = 0  # examples of the current epoch's permutation already served
        self._perm: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.examples) // self.batch_size)

    def _permutation(self) -> list[int]:
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(len(self.examples), generator=g).tolist()
        return self._perm

    def next(self) -> Batch:
        """The next batch; rolls over to a fresh permutation at each epoch end."""
        if self.index >= len(self.examples):
            self.epoch += 1
            self.index = 0
            self._perm = None
        perm = self._permutation()
        picked = perm[self.index : self.index + self.batch_size]
        self.index += len(picked)
        return self._collate([self.examples[i] for i in picked])

    def _collate(self, picked: list[Any]) -> Batch:
        """One batch of the picked items (preference.PairStream: pairs, two rows each)."""
        return collate(picked, self.pad_id)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next()

    def state_dict(self) -> dict[str, int]:
        """JSON-serializable position, for checkpoints."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position saved by `state_dict` (same examples, batch size and seed)."""
        epoch, index = state.get("epoch"), state.get("index")
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, index))
        if not ok:
            raise MespError(f"bad data stream state {state!r}: need non-negative 'epoch', 'index'")
        assert isinstance(epoch, int) and isinstance(index, int)
        if index > len(self.examples):
            raise MespError(
                f"data stream state has index {index} but the training set has only "
                f"{len(self.examples)} examples; was the data changed since the checkpoint?"
            )
        self.epoch, self.index, self._perm = epoch, index, None


def iter_eval_batches(
    examples: Sequence[Example], batch_size: int, pad_id: int = 0
) -> Iterator[Batch]:
    """Batches in the given order, once through, so evaluation numbers are comparable."""
    if batch_size < 1:
        raise MespError(f"--batch-size must be at least 1, got {batch_size}")
    for i in range(0, len(examples), batch_size):
        yield collate(examples[i : i + batch_size], pad_id)
