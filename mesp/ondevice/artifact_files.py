"""The files of an artifact directory: the safetensors dtype names, each file's table and
digest (run_config.json checks both before training), and the writer that builds the directory
in a temporary sibling and renames it into place only once everything is written."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mesp.errors import MespError

ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def table(tensors: dict[str, Tensor]) -> dict[str, Any]:
    return {k: {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape)} for k, t in tensors.items()}


def digest(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().reshape(-1)
        h.update(k.encode())
        h.update(ST_DTYPES[t.dtype].encode() + str(list(tensors[k].shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Writer:
    """Files go to a temporary sibling of out_dir, renamed into place once all are written."""

    def __init__(self, out_dir: Path) -> None:
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise MespError(
                f"{out_dir}: exists and is not an empty directory; choose another --out"
            )
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
        except OSError as e:
            raise MespError(f"{out_dir}: cannot create ({e.strerror or e})") from None
        self.out = out_dir

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def commit(self) -> None:
        # mkdtemp makes the directory 0700 and safetensors its files 0600: give everything the
        # mode a plain mkdir / open would, so other users and servers can read the artifacts
        mask = os.umask(0)
        os.umask(mask)
        for p in [self.tmp, *self.tmp.rglob("*")]:
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
        if self.out.exists():
            self.out.rmdir()  # empty, checked above
        self.tmp.rename(self.out)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
