"""`--ref-cache DIR`: DPO's reference log-probabilities kept on disk per row, reused across
epochs and resumes (issue 30 item 3).

The reference is the base model with the adapter off, which training never changes, so a row's
reference log-prob is a function of the row alone. A row is keyed by the SHA-256 of its tokens,
targets and completion mask; its value, an fp64, is stored exactly (float.hex) as one line of
DIR/ref_logps.jsonl, appended and flushed as soon as it is computed (a crash loses at most the
line being written; a torn last line is ignored on reading).

What the key leaves out is the base model itself. Instead of trusting a name, the first batch a
process looks up whose rows are all cached is also recomputed, and the cache is refused in one
line unless both agree (relative 1e-6: another thread count may sum in another order). So a
cache made with another model, quantization or dtype never feeds a step. After that check,
cached values are used as they are: a resumed run reads the same bits its first run wrote.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

from mesp.batch import Batch
from mesp.errors import MespError

FILE = "ref_logps.jsonl"
AGREE = 1e-6  # relative: the same model's log-prob summed in another order


def row_keys(batch: Batch) -> list[str]:
    """Each row's key: SHA-256 of its input ids, targets (int64) and completion mask."""
    ids, tgt = batch.input_ids.cpu().to(torch.int64), batch.targets.cpu().to(torch.int64)
    mask = batch.mask.cpu().to(torch.uint8)
    keys = []
    for i in range(ids.shape[0]):
        h = hashlib.sha256()
        for t in (ids[i], tgt[i], mask[i]):
            h.update(t.contiguous().numpy().tobytes())
            h.update(b"|")
        keys.append(h.hexdigest())
    return keys


class RefCache:
    """The reference log-probs on disk under `root`, read once when opened."""

    def __init__(self, root: Path) -> None:
        if root.exists() and not root.is_dir():
            raise MespError(f"--ref-cache {root}: not a directory")
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / FILE
        self.values: dict[str, float] = {}
        self.verified = False
        self.hits = self.misses = 0
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.values[rec["k"]] = float.fromhex(rec["v"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash: that row is computed again

    def lookup(self, keys: list[str]) -> Tensor | None:
        """(B,) fp64 when every row is cached, else None."""
        if not all(k in self.values for k in keys):
            self.misses += 1
            return None
        self.hits += 1
        return torch.tensor([self.values[k] for k in keys], dtype=torch.float64)

    def verify(self, cached: Tensor, computed: Tensor) -> None:
        """The first hit of a process, against the reference computed now."""
        err = float((cached - computed).abs().max() / computed.abs().max().clamp(min=1.0))
        if err > AGREE:
            raise MespError(
                f"--ref-cache {self.path.parent}: its reference log-probs differ from this "
                f"model's (relative {err:.1e}): it was made with another base model, "
                "quantization or dtype; give another directory"
            )
        self.verified = True

    def store(self, keys: list[str], ref: Tensor) -> None:
        new = [(k, float(v)) for k, v in zip(keys, ref.tolist(), strict=True)]
        new = [(k, v) for k, v in new if k not in self.values]
        if not new:
            return
        with self.path.open("a") as f:
            for k, v in new:
                f.write(json.dumps({"k": k, "v": v.hex()}) + "\n")
                self.values[k] = v
            f.flush()


def attach_ref_cache(engine: object, root: str | None, objective: str) -> None:
    """`--ref-cache DIR` on a preference engine (mesp train, mesp grad): not an engine option,
    so cached values leave a run's resume fingerprint alone."""
    if not root:
        return
    if objective != "dpo":
        raise MespError("--ref-cache keeps DPO's reference log-probs: needs --objective dpo")
    engine.ref_cache = RefCache(Path(root))  # type: ignore[attr-defined]


__all__ = ["RefCache", "attach_ref_cache", "row_keys"]
