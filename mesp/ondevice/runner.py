"""What both drivers of `mesp export`'s programs share on the Python side: the artifact directory
(run_config.json and every file checked against it before any work, frozen weights read lazily,
one block at a time), the batches, and the command line of `mesp run-artifacts` / `python -m
mesp.runner`; it re-exports mesp.ondevice.run_files (the rows file, the adapter files, the
error), so that this module is the drivers' whole shared surface. torch and safetensors only:
the model code is never imported (the programs are the whole model). The loop itself is
mesp.ondevice.et_driver's (the .pte programs through executorch.runtime); the native runner
(runtime/) is its C++ twin.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mesp.errors import MespError
from mesp.ondevice import private
from mesp.ondevice.contract import FORMAT, VERSION
from mesp.ondevice.run_files import (
    PEFT_PREFIX,
    RunnerError,
    read_rows,
    save_adapter,
    write_atomic,
)

Tensors = dict[str, torch.Tensor]

__all__ = [
    "PEFT_PREFIX",
    "Artifacts",
    "RunConfig",
    "RunnerError",
    "add_arguments",
    "batches",
    "make_batch",
    "read_rows",
    "run",
    "run_cli",
    "save_adapter",
    "write_atomic",
]


# ---- the artifact directory: checked up front, weights read lazily ----


class Artifacts:
    """run_config.json, and every file checked against it (export id, names, shapes, dtypes)
    before any training. Block weights are read only inside `block(i)`; the programs are the
    driver's to check and load."""

    def __init__(self, root: Path, on_load: Callable[[Tensors], None] | None = None) -> None:
        self.root, self.on_load = root, on_load
        conf_p = root / "run_config.json"
        if not root.is_dir():
            raise RunnerError(f"{root}: not an artifact directory")
        if not conf_p.is_file():
            raise RunnerError(f"{conf_p}: missing (not a `mesp export` directory?)")
        try:
            self.conf = json.loads(conf_p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunnerError(f"{conf_p}: unreadable: {e}") from None
        c = self.conf
        if not isinstance(c, dict) or c.get("format") != FORMAT or c.get("version") != VERSION:
            raise RunnerError(f"{conf_p}: not a {FORMAT} v{VERSION} config")
        try:
            self.id = str(c["export_id"])
            self.seq_len, self.batch_size = int(c["seq_len"]), int(c["batch_size"])
            self.vocab = int(c["model"]["vocab_size"])
            for rel, spec in c["files"].items():
                self._check_file(rel, spec["tensors"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RunnerError(f"{conf_p}: malformed ({type(e).__name__}: {e})") from None
        self.resident_bytes = self.peak_resident_bytes = 0
        self.ctx = self._read("context.safetensors")
        self.embed_w = self._resident("embedding.safetensors")
        self.head_w = self._resident("head.safetensors")

    def _check_file(self, rel: str, table: dict[str, Any]) -> None:
        p = self.root / rel
        if not p.is_file():
            raise RunnerError(f"{p}: missing (the export is incomplete; run mesp export again)")
        try:
            with safe_open(str(p), framework="pt") as f:
                meta, names = f.metadata() or {}, set(f.keys())
                shapes = {
                    k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in names
                }
        except Exception as e:  # safetensors raises its own error types
            raise RunnerError(f"{p}: not a readable safetensors file ({e})") from None
        if meta.get("export_id") != self.id:
            raise RunnerError(
                f"{p}: made by export {meta.get('export_id')}, but run_config.json is from "
                f"export {self.id} (files of two exports mixed?)"
            )
        if names != set(table):
            extra = sorted(names ^ set(table))[0]
            raise RunnerError(f"{p}: tensor {extra!r} does not match run_config.json")
        for k, want in table.items():
            dt, shape = shapes[k]
            if dt != want["dtype"] or list(shape) != list(want["shape"]):
                raise RunnerError(
                    f"{p}: tensor {k!r} is {dt}{list(shape)}, run_config.json says "
                    f"{want['dtype']}{list(want['shape'])}"
                )

    def _read(self, rel: str) -> Tensors:
        try:
            return load_file(str(self.root / rel))
        except Exception as e:  # changed on disk since the check
            raise RunnerError(f"{self.root / rel}: unreadable ({e})") from None

    def _resident(self, rel: str) -> Tensors:
        w = self._read(rel)
        self._count(w, +1)
        return w

    def _count(self, w: Tensors, sign: int) -> None:
        self.resident_bytes += sign * sum(t.numel() * t.element_size() for t in w.values())
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        if sign > 0 and self.on_load is not None:
            self.on_load(w)

    @contextmanager
    def block(self, i: int) -> Iterator[Tensors]:
        """Block i's frozen weights, read from disk now and dropped on exit."""
        w = self._read(self.conf["blocks"][i]["file"])
        self._count(w, +1)
        try:
            yield w
        finally:
            self._count(w, -1)
            w.clear()


# ---- data ----


def make_batch(
    rows: list[tuple[list[int], list[int]]], batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, targets, trained) (B, S): shifted by one, right-padded with id 0, untrained."""
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    tgt = torch.zeros(batch_size, seq_len, dtype=torch.long)
    mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    for r, (toks, m) in enumerate(rows):
        k = len(toks) - 1
        ids[r, :k] = torch.tensor(toks[:-1])
        tgt[r, :k] = torch.tensor(toks[1:])
        mask[r, :k] = torch.tensor(m[1:], dtype=torch.bool)
    return ids, tgt, mask


def batches(rows: list[tuple[list[int], list[int]]], batch_size: int) -> Iterator[list[Any]]:
    """Consecutive rows in file order, wrapping around: step k uses rows kB .. kB + B - 1."""
    k = 0
    while True:
        yield [rows[(k * batch_size + j) % len(rows)] for j in range(batch_size)]
        k += 1


@dataclass
class RunConfig:
    steps: int
    lr: float = 1e-4
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    checkpoints_dir: str | None = None  # block inputs in a scratch file there, not in memory
    dp: Any = None  # DP-SGD: a mesp.ondevice.private.DpPlan, or None
    checkpoint_dtype: str = "float32"  # block inputs kept as computed, or float16 / bfloat16


# ---- CLI ----


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The runner's flags (also registered as `mesp run-artifacts`)."""
    p.add_argument("artifacts", metavar="DIR", help="directory written by `mesp export`")
    p.add_argument("--data", required=True, help="jsonl of {input_ids, loss_mask} rows")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default: 1e-4)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--out", required=True, help="adapter directory (PEFT format)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.add_argument(
        "--checkpoints-dir",
        metavar="DIR",
        default=None,
        help="keep the block inputs in a nameless scratch file in DIR (written in the forward, "
        "read back in the backward) instead of in memory: the same numbers, one block's input "
        "resident instead of all of them",
    )
    p.add_argument(
        "--checkpoint-dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="keep the block inputs as computed (float32, exact) or rounded to float16 / "
        "bfloat16 (half their memory; the backward recomputes from the rounded input)",
    )
    private.add_arguments(p)


def run(ns: argparse.Namespace, train_fn: Callable[..., Any]) -> int:
    """Check the flags, artifacts and rows, train with `train_fn` (mesp.ondevice.et_driver's
    `train`), save the adapter."""
    if ns.steps < 1 or not (ns.lr > 0 and math.isfinite(ns.lr)):
        raise RunnerError("--steps and --lr must be positive")
    out = Path(ns.out)
    if out.exists() and not out.is_dir():
        raise RunnerError(f"{out}: exists and is not a directory")
    t0 = time.perf_counter()
    art = Artifacts(Path(ns.artifacts))
    rows = read_rows(Path(ns.data), art.seq_len, art.vocab)
    try:
        dp = private.DpPlan.resolve(ns, len(rows), ns.steps, art.batch_size)
    except MespError as e:
        raise RunnerError(str(e)) from None

    last = [time.perf_counter()]

    def log(k: int, loss: float | None, note: str = "") -> None:
        now = time.perf_counter()
        if not ns.quiet:
            empty = "none (noise only)" if dp else "skipped (no trained token)"
            shown = empty if loss is None else f"{loss:.6f}"
            print(f"step {k} loss {shown} time {now - last[0]:.3f}s{_rss_note()}{note}", flush=True)
        last[0] = now

    cfg = RunConfig(ns.steps, ns.lr, ns.optimizer, ns.weight_decay, ns.checkpoints_dir, dp)
    cfg.checkpoint_dtype = ns.checkpoint_dtype
    trainer, _ = train_fn(art, rows, cfg, log)
    note = save_adapter(trainer, out)
    if note:
        print(note, flush=True)
    if dp is not None:  # the guarantee the adapter was trained under, beside it
        try:
            text = dp.privacy_json(ns.steps)
            write_atomic(out / "privacy.json", lambda p: Path(p).write_text(text))
        except OSError as e:
            raise RunnerError(f"{out}: could not save privacy.json ({e.strerror or e})") from None
        print(dp.summary(ns.steps), flush=True)
    print(
        f"saved {out} after {ns.steps} steps in {time.perf_counter() - t0:.1f}s; frozen weights "
        f"resident at most {art.peak_resident_bytes / 2**20:.1f} MiB",
        flush=True,
    )
    return 0


def _rss_note() -> str:
    """' peak_rss X MiB anon Y MiB' from /proc/self/status where there is one (Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return ""
    kb = {
        k: int(v.split()[0])
        for k, _, v in (line.partition(":") for line in text.splitlines())
        if k in ("VmHWM", "RssAnon")
    }
    if len(kb) < 2:
        return ""
    return f" peak_rss {kb['VmHWM'] / 1024:.1f}MiB anon {kb['RssAnon'] / 1024:.1f}MiB"


def run_cli(ns: argparse.Namespace, train_fn: Callable[..., Any]) -> int:
    """run(ns) with errors as one line and exit code 2 (130 when interrupted)."""
    try:
        return run(ns, train_fn)
    except RunnerError as e:
        print(f"mesp-runner: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mesp-runner: interrupted; no adapter written", file=sys.stderr)
        return 130
