"""`mesp bench ondevice --memory-cap MB | --find-cap`: the native runner, and `mesp train` on
the same configuration, inside a hard memory cap (mesp/memory/cgroup.py).

`--memory-cap MB` runs the native runner's steps in a group capped at MB and records whether
they completed (a run the cap kills is said so in one line, with the cap). `--find-cap`
bisects, to 8 MB, the smallest cap in which 3 steps complete: for the native runner on the
exported programs, and for `mesp train` (mesp engine, the same random weights' shape, 4-bit,
rank, sequence, SGD) from its own process, so both are charged everything they touch,
interpreter and libraries included. The group is charged page cache too (the mapped programs
and weights); clean pages are reclaimed before the kernel kills, so the cap found is what the
run needs resident, which is below the group's peak charge.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from mesp.bench.ondevice import OndeviceConfig, export_programs, label, native_argv, rows_file
from mesp.bench.output import write_row
from mesp.errors import MespError
from mesp.memory.cgroup import MB, CappedRun, find_cap, run_capped

CAP_STEPS = 3  # the steps a cap must hold (the first one included)
FIND_LOW, FIND_HIGH = 16 * MB, 4000 * MB


def train_argv(c: OndeviceConfig, work: Path, data: Path) -> list[str]:
    """`mesp train` on the configuration the runner was exported with (a real model: its codes
    as stored, as the export keeps them)."""
    argv = [sys.executable, "-m", "mesp.cli", "train"]
    if c.model:
        argv += ["--model", c.model, "--dtype", "float32"]
    else:
        argv += ["--model", f"random:{c.shape}", "--quantize", str(c.bits)]
        argv += ["--group-size", str(c.group_size), "--dtype", "float32"]
    argv += ["--engine", "mesp", "--rank", str(c.rank), "--seq-len", str(c.seq)]
    argv += ["--batch-size", str(c.batch), "--steps", str(c.steps), "--optimizer", "sgd"]
    argv += ["--lr", repr(c.lr), "--warmup", "0", "--data", str(data), "--eval-every", "0"]
    argv += ["--eval-batches", "1", "--save-every", "0", "--no-progress"]
    return argv + ["--adapter-out", str(work / "train-adapter")]


def _summary(r: CappedRun) -> dict[str, Any]:
    return {
        "cap_mb": r.cap_bytes / MB,
        "ok": r.ok,
        "killed": r.killed,
        "peak_charge_mb": r.peak_bytes / MB,
        "seconds": r.seconds,
        "why": r.why(),
    }


def run_caps(
    out: Path, c: OndeviceConfig, cmd: str, cap_mb: float | None, find: bool, timeout: float
) -> list[dict[str, Any]]:
    c = replace(c, steps=CAP_STEPS) if find else c
    work = out / "runs" / f"ondevice-{c.export_name}"
    work.mkdir(parents=True, exist_ok=True)
    art = work / "art"
    export_programs(c, art, timeout)
    conf = json.loads((art / "run_config.json").read_text())
    data = rows_file(c, conf["model"]["vocab_size"], work / "rows.jsonl")
    native = native_argv(c, art, data, work / "adapter", work / "native.jsonl")

    def run_native(cap: int) -> CappedRun:
        return run_capped(native, cap, timeout)

    def run_train(cap: int) -> CappedRun:
        return run_capped(train_argv(c, work, data), cap, timeout)

    row: dict[str, Any] = {"table": "ondevice-cap", "status": "ok", "config": asdict(c)}
    if cap_mb is not None:
        r = run_native(int(cap_mb * MB))
        row["native_at_cap"] = _summary(r)
        if not r.ok:
            print(f"mesp: native runner: {r.why()}", file=sys.stderr)
    if find:
        for name, fn in (("native", run_native), ("train", run_train)):
            try:
                cap, tried = find_cap(fn, FIND_LOW, FIND_HIGH)
            except MespError as e:
                raise MespError(f"--find-cap, {name}: {e}") from None
            row[f"{name}_cap_mb"] = cap / MB
            row[f"{name}_tries"] = [_summary(t) for t in tried]
    row["command"] = cmd
    return [write_row(out / "rows" / "ondevice-cap" / f"{c.name}.json", row, line, "ondevice")]


def line(r: dict[str, Any]) -> str:
    parts = [f"{label(r['config'])}, {r['config']['steps']} steps"]
    if "native_at_cap" in r:
        parts.append(f"native: {r['native_at_cap']['why']}")
    if "native_cap_mb" in r:
        parts.append(
            f"smallest cap: native {r['native_cap_mb']:.0f} MB, mesp train "
            f"{r['train_cap_mb']:.0f} MB (to 8 MB)"
        )
    return "; ".join(parts)


def section(rows: list[dict[str, Any]]) -> list[str]:
    found = [r for r in rows if r.get("table") == "ondevice-cap" and "native_cap_mb" in r]
    if not found:
        return []
    lines = [
        "### Inside a hard memory cap",
        "",
        "The smallest memory cgroup (no swap) in which 3 steps complete, bisected to 8 MB "
        "(`mesp bench ondevice --find-cap`): the native runner on its exported programs, and "
        "`mesp train` (engine mesp, same shape and weights, rank, sequence, SGD) from a fresh "
        "process. The group is charged page cache as well; clean pages are reclaimed before "
        "the kernel kills, so the cap is what must stay resident, below the group's peak charge.",
        "",
        "| shape | seq | native cap MB | mesp train cap MB | native / train |",
        "|---|---|---|---|---|",
    ]
    for r in found:
        c = r["config"]
        n, t = r["native_cap_mb"], r["train_cap_mb"]
        lines.append(f"| {label(c)} | {c['seq']} | {n:.0f} | {t:.0f} | {n / t:.2f} |")
    return lines + [""]
