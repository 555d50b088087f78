"""Tiny models of each family exported with `--target executorch` (see tests/conftest.py).

Lowering takes minutes per model and is single-threaded Python: `prefetch` exports several in
worker processes, one per core. The models are deterministic (seeded), so the one a test builds
in-process equals the one a worker exported. Under pytest-xdist the test workers share one root
(tests/conftest.py): each case is exported once, under its lock, and found done by the others."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from mesp.ondevice import runner
from mesp.ondevice.export import ExportOptions, export_model
from tests import export_cases as T

S, B, TILE = T.S, T.B, 4  # S = 12: three query tiles


# Phi-3's original context below S, so its programs run LongRoPE's long factor set (and the
# attention factor it brings): the short set is what the fast suite's Phi-3 exports trace
OVER: dict[str, dict[str, int]] = {"phi3": {"original_max_position_embeddings": 8}}


def _model(family: str, quant: str):  # type: ignore[no-untyped-def]
    """quant: "q4" (every frozen matrix 4-bit g32), "dense", or "mixed" (T.mixed_model)."""
    if quant == "mixed":
        return T.mixed_model(family, **OVER.get(family, {}))
    return T.model_with_adapter(family, T.Q4 if quant == "q4" else None, **OVER.get(family, {}))


def export_case(family: str, quant: str, out: Path, weight_block_kb: int = 0) -> Path:
    """Export the tiny model to `out` (in a worker or in-process), with one torch thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a shared 2-core machine
    try:
        vchunk = T.CASES[family][1] or 8192
        opts = ExportOptions(
            S, B, vchunk, target="executorch", attn_tile=TILE, weight_block_kb=weight_block_kb
        )
        export_model(_model(family, quant), out, opts)
    finally:
        torch.set_num_threads(n)
    return out


def ensure_case(family: str, quant: str, out: Path, weight_block_kb: int = 0) -> Path:
    """Export the case to `out` unless it is there; one process at a time per case (the export
    directory is committed whole, so a run_config.json means a finished export)."""
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "run_config.json").exists():
            export_case(family, quant, out, weight_block_kb)
    return out


def prefetch(cases: list[tuple[str, str]], root: Path) -> None:
    """Export every case not yet under root, in parallel worker processes."""
    todo = [
        c
        for c in dict.fromkeys(cases)  # once each: two workers must never share a directory
        if not (root / f"et_{c[0]}_{c[1]}" / "run_config.json").exists()
    ]
    if len(todo) < 2:
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(len(todo), os.cpu_count() or 1), mp_context=ctx) as pool:
        jobs = [pool.submit(ensure_case, f, q, root / f"et_{f}_{q}") for f, q in todo]
        for j in jobs:
            j.result()


class EtCase:
    def __init__(self, family: str, quant: str, root: Path, weight_block_kb: int = 0) -> None:
        self.family = family
        self.vchunk = T.CASES[family][1] or 8192
        self.model = _model(family, quant)
        self.init = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.dir = root / f"et_{family}_{quant}" if not weight_block_kb else root / "et_blocked"
        ensure_case(family, quant, self.dir, weight_block_kb)
        self.art = runner.Artifacts(self.dir)
        self.conf = self.art.conf

    def reset(self) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.init[n])
