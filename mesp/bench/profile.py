"""`mesp bench profile`: where one training step's time goes, by kind of work.

The matmul floor (mesp.bench.floor) says how far a step is from its GEMMs at the probed rate;
this says what the rest is. One configuration of table 1 (random weights of the named shape,
LoRA on the seven projections, the same engine setup as `mesp.bench.child`), warm-up steps,
then one step under torch.profiler, and the self time of every torch op summed by kind:

  gemm         mm / addmm / bmm and friends (the projections, the head, LoRA's rank-r products)
  attention    the flash-attention forward and backward kernels
  elementwise  everything else torch runs (norms, RoPE, activations, softmax pieces, copies)
  outside ops  the step's wall time that no torch op holds: the native dequantizer (a ctypes
               call, no torch op), Python, and the profiler's own cost

plus the GEMMs' achieved rate (their flops at the shapes a second profiled step recorded, over
their time in the first: recording shapes perturbs the heap, so the split comes from a step
profiled without them). The profiled step runs slower than an unprofiled one (the profiler
records every op), so read the shares, not the seconds; the timed steps before it are plain,
for comparison, and the row keeps the minor page faults of the profiled step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mesp.bench.output import write_row

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}
ATTENTION_MARK = "scaled_dot_product"
KINDS = ("gemm", "attention", "elementwise", "outside ops")


def _gemm_flops(name: str, shapes: list[Any]) -> int:
    """2·m·k·n of one GEMM call from the profiler's input shapes (0 where they are unknown)."""
    try:
        if name in ("aten::mm",):
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2 * m * k * n
        if name in ("aten::addmm", "aten::addmm_"):
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2 * m * k * n
        if name in ("aten::bmm", "aten::baddbmm"):
            off = 0 if name == "aten::bmm" else 1
            (b, m, k), (_, _, n) = shapes[off], shapes[off + 1]
            return 2 * b * m * k * n
    except (IndexError, TypeError, ValueError):
        return 0
    return 0


def kind_of(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if ATTENTION_MARK in name:
        return "attention"
    return "elementwise"


def breakdown(events: Iterable[Any], wall_s: float) -> dict[str, Any]:
    """Self seconds per kind from profiler events (key_averages grouped by input shape), the
    wall time no op holds, and the GEMMs' flops and rate."""
    secs = dict.fromkeys(KINDS, 0.0)
    flops, by_op = 0, {}  # op -> (self seconds, calls), over every input shape
    for e in events:
        s = e.self_cpu_time_total / 1e6
        k = kind_of(e.key)
        secs[k] += s
        if k == "gemm":
            flops += _gemm_flops(e.key, e.input_shapes) * e.count
        t, n = by_op.get(e.key, (0.0, 0))
        by_op[e.key] = (t + s, n + e.count)
    secs["outside ops"] = max(0.0, wall_s - sum(secs.values()))
    top = sorted(((t, op, n) for op, (t, n) in by_op.items()), reverse=True)
    non_gemm = [t for t in top if kind_of(t[1]) != "gemm"][:8]
    return {
        "seconds": secs,
        "shares": {k: v / wall_s for k, v in secs.items()},
        "gemm_flops": flops,
        "gemm_gflops": flops / secs["gemm"] / 1e9 if secs["gemm"] else None,
        "top_non_gemm": [{"op": n, "seconds": s, "calls": c} for s, n, c in non_gemm],
    }


def run_profile(
    out: Path, engine: str, shape: str, dtype: str, bits: int | None, steps: int, warmup: int,
    command: str,
) -> list[dict[str, Any]]:  # fmt: skip
    """Time `steps` plain steps, then profile one; one row under OUT/rows/profile/."""
    from torch.profiler import ProfilerActivity, profile

    from mesp.bench.floor import GemmProbe, matmul_floor
    from mesp.bench.variants import ChildConfig, mesp_setup, model_config, random_batch

    c = ChildConfig(variant=engine, engine=engine, shape=shape, dtype=dtype, bits=bits)
    cfg = model_config(c)
    tokens = c.batch * c.seq
    probe = GemmProbe(cfg, tokens, getattr(torch, dtype))
    step, *_ = mesp_setup(c, getattr(torch, dtype), random_batch(c))
    for _ in range(warmup):
        step()
    times, rates, plain_faults = [], [], []
    for _ in range(steps):
        rates.append(probe.rate(passes=3)["gflops"])
        f0, t = _minor_faults(), time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        plain_faults.append(_minor_faults() - f0)
    # the split from a step profiled without shapes: recording shapes perturbs the heap enough
    # that fresh outputs page-fault, which inflated elementwise ops 4-6x in a trial run
    faults = _minor_faults()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        step()
        wall = time.perf_counter() - t
    faults = _minor_faults() - faults
    b = breakdown(prof.key_averages(), wall)
    # the GEMMs' flops (the same in every step) from one more step, profiled with shapes
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as shaped:
        step()
    flops = breakdown(shaped.key_averages(group_by_input_shape=True), wall)["gemm_flops"]
    gemm_s = b["seconds"]["gemm"]
    b.update(gemm_flops=flops, gemm_gflops=flops / gemm_s / 1e9 if gemm_s else None)
    rate = statistics.median(rates)
    row = {
        "table": "profile",
        "status": "ok",
        "command": command,
        "config": {"engine": engine, "shape": shape, "dtype": dtype, "bits": bits,
                   "seq": c.seq, "rank": c.rank, "threads": torch.get_num_threads()},
        "steps_s": times,
        "median_s": statistics.median(times),
        "probe_gflops": rate,
        "floor_s": matmul_floor(cfg, tokens, rate)["seconds"],
        "profiled_s": wall,
        "minor_faults": faults,
        "plain_minor_faults": plain_faults,
        **b,
    }  # fmt: skip
    name = f"{engine}_{shape}_{dtype}_{'q' + str(bits) if bits else 'dense'}.json"
    write_row(out / "rows" / "profile" / name, row, line, "profile")
    return [row]


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def line(r: dict[str, Any]) -> str:
    c, sh = r["config"], r["shares"]
    kinds = ", ".join(f"{k} {sh[k]:.0%}" for k in KINDS)
    return (
        f"{c['engine']} {c['shape']} {c['dtype']} {'q' + str(c['bits']) if c['bits'] else 'dense'}"
        f": {r['median_s']:.3g} s/step (floor {r['floor_s']:.3g} s); profiled step: {kinds}; "
        f"GEMMs at {r['gemm_gflops']:.0f} GFLOP/s against {r['probe_gflops']:.0f} probed"
    )


def section(rows: list[dict[str, Any]]) -> list[str]:
    ok = [r for r in rows if r.get("table") == "profile" and r.get("status") == "ok"]
    if not ok:
        return []
    lines = [
        "## Where a step's time goes (`mesp bench profile`)",
        "",
        f"`{ok[0]['command']}` — one step under torch.profiler after plain timed steps; self "
        "time of every torch op summed by kind, and the wall time no torch op holds (the native "
        "dequantizer is a ctypes call, so it lands there, with Python). The profiler slows the "
        "step it records, so the shares matter, not its seconds.",
        "",
        "| engine | dtype | base | plain s/step (floor s) | profiled s | gemm | attention | "
        "elementwise | outside ops | GEMM GFLOP/s achieved / probed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ok:
        c, sh = r["config"], r["shares"]
        base = f"{c['bits']}-bit" if c["bits"] else "dense"
        lines.append(
            f"| {c['engine']} | {c['dtype']} | {base} | {r['median_s']:.3g} ({r['floor_s']:.3g}) "
            f"| {r['profiled_s']:.3g} | "
            + " | ".join(f"{sh[k]:.0%}" for k in KINDS)
            + f" | {r['gemm_gflops']:.0f} / {r['probe_gflops']:.0f} |"
        )
    lines.append("")
    for r in ok:
        top = ", ".join(
            f"{t['op'].removeprefix('aten::')} {t['seconds'] * 1e3:.0f} ms ({t['calls']})"
            for t in r["top_non_gemm"]
        )
        base = "4-bit" if r["config"]["bits"] else "dense"
        faults = ""
        if "plain_minor_faults" in r:  # the profiler's own allocations can make fresh pages fault
            plain = ", ".join(map(str, r["plain_minor_faults"]))
            faults = f"; minor page faults: {r['minor_faults']} profiled, {plain} in plain steps"
        lines.append(
            f"- {r['config']['engine']}, {base}: largest non-GEMM ops (calls): {top}{faults}."
        )
    return lines + [""]


__all__ = ["breakdown", "kind_of", "line", "run_profile", "section"]
