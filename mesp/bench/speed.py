"""`mesp bench speed`: engines' step times side by side, in one process, round by round.

Table 1 times each engine in its own process, minutes apart. On this shared 2-core machine the
speed drifts by ±20% within a minute (GEMM probes of one process read 90-174 GFLOP/s, one
engine's consecutive steps 5.7-7.8 s), so a tokens/s ratio between two such processes carries
that drift. Here every variant's model is built in one process (no malloc setting: time only)
and the variants run in rounds: each round probes the GEMM rate (mesp.bench.floor), then runs
one step of every variant, the order rotated from round to round so that none always runs
right after the probe. A ratio is taken inside each round, between steps seconds apart, and
the median over rounds is reported; each step is also set against the matmul floor at its own
round's probe. A variant is a table-1 variant (mesp, mebp, bp, peft-gc, mesp-fp, mesp-budget,
…), optionally with a dtype of its own: `mesp:bfloat16`.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mesp.bench.output import write_row
from mesp.errors import MespError

Row = dict[str, Any]


def parse_variant(text: str, dtype: str) -> tuple[str, str]:
    """'mesp' -> ('mesp', dtype); 'mesp:bfloat16' -> ('mesp', 'bfloat16')."""
    from mesp.bench.tables import VARIANTS

    name, _, own = text.partition(":")
    if name not in VARIANTS:
        raise MespError(f"speed: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    if own and own not in ("float32", "bfloat16", "float16"):
        raise MespError(f"speed: {text!r}: the dtype after ':' must be float32, bfloat16, float16")
    return name, own or dtype


def _build(variant: str, dtype: str, shape: str, seq: int, rank: int) -> Callable[[], float]:
    """One variant's training step, set up as table 1's time child sets it up."""
    from mesp.bench.tables import VARIANTS
    from mesp.bench.tracking import Fp32Matmul
    from mesp.bench.variants import ChildConfig, mesp_setup, peft_setup, random_batch
    from mesp.ops import matmul as matmul_ops

    c = ChildConfig(variant=variant, shape=shape, seq=seq, rank=rank, dtype=dtype,
                    **VARIANTS[variant])  # fmt: skip
    if c.engine in ("mezo",) or c.offload != "none":
        raise MespError(f"speed: {variant} is not timed side by side (disk or zeroth order)")
    tdtype = getattr(torch, dtype)
    setup = peft_setup if c.engine == "peft" else mesp_setup
    step = setup(c, tdtype, random_batch(c))[0]
    fp32_mm = matmul_ops.computes_in_fp32(torch.empty(0, dtype=tdtype))
    if c.engine != "peft" or not fp32_mm:
        return step

    def baseline() -> float:  # PEFT's bf16 matmuls on the fp32 GEMM, as table 1's child runs it
        with Fp32Matmul():
            return step()

    return baseline


def run_speed(
    out: Path, shape: str, seq: int, rank: int, dtype: str, variants: tuple[str, ...],
    rounds: int, warmup: int, command: str, matmul: str = "auto",
) -> list[Row]:  # fmt: skip
    """Build every variant, warm each up, then `rounds` rounds; one row under OUT/rows/speed/.
    matmul: mesp.ops.matmul's bf16 switch for this process (fp32: bf16 computed in fp32, as on
    a CPU without a bf16 GEMM, also where this one has it)."""
    from mesp.ops import matmul as matmul_ops

    if rounds < 1 or warmup < 0:
        raise MespError("speed: --steps (rounds) must be >= 1 and --warmup >= 0")
    before = os.environ.get(matmul_ops.ENV)
    os.environ[matmul_ops.ENV] = matmul
    try:
        matmul_ops.mode()  # a bad value: one line, before anything is built
        return [_run(out, shape, seq, rank, dtype, variants, rounds, warmup, command, matmul)]
    finally:  # the switch is this run's, not the caller's
        if before is None:
            os.environ.pop(matmul_ops.ENV, None)
        else:
            os.environ[matmul_ops.ENV] = before


def _run(
    out: Path, shape: str, seq: int, rank: int, dtype: str, variants: tuple[str, ...],
    rounds: int, warmup: int, command: str, matmul: str,
) -> Row:  # fmt: skip
    from mesp.bench.floor import GemmProbe, matmul_floor, probe_dtype
    from mesp.bench.variants import ChildConfig, model_config
    from mesp.ops import matmul as matmul_ops

    parsed = [parse_variant(v, dtype) for v in variants]
    names = [f"{v}:{d}" for v, d in parsed]
    if len(set(names)) != len(names):
        raise MespError(f"speed: a variant is named twice in {', '.join(variants)}")
    cfg = model_config(ChildConfig(variant="mesp", engine="mesp", shape=shape))
    tokens = seq
    # one probe per dtype the GEMMs really run in; each variant's steps use its own
    runs_in = {n: probe_dtype(getattr(torch, d)) for n, (_, d) in zip(names, parsed, strict=True)}
    probes = {run: GemmProbe(cfg, tokens, run) for run in dict.fromkeys(runs_in.values())}
    steps = {n: _build(v, d, shape, seq, rank) for n, (v, d) in zip(names, parsed, strict=True)}
    for n in names:
        for _ in range(warmup):
            steps[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    floors: dict[str, list[float]] = {n: [] for n in names}
    rates: dict[str, list[float]] = {str(k).removeprefix("torch."): [] for k in probes}
    for i in range(rounds):
        rate = {k: p.rate(passes=3)["gflops"] for k, p in probes.items()}
        for k, g in rate.items():
            rates[str(k).removeprefix("torch.")].append(g)
        for j in range(len(names)):
            n = names[(i + j) % len(names)]  # rotated: each variant takes each place in turn
            gc.collect()
            t = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t)
            fl = matmul_floor(cfg, tokens, rate[runs_in[n]])["seconds"]
            floors[n].append(times[n][-1] / fl)
    per = {
        n: {"steps_s": times[n], "median_s": statistics.median(times[n]),
            "tokens_per_s": tokens / statistics.median(times[n]),
            "floor_ratios": floors[n], "floor_ratio": statistics.median(floors[n])}
        for n in names
    }  # fmt: skip
    row: Row = {
        "table": "speed",
        "status": "ok",
        "command": command,
        "config": {"shape": shape, "seq": seq, "rank": rank, "dtype": dtype, "rounds": rounds,
                   "warmup": warmup, "variants": names, "threads": torch.get_num_threads(),
                   "matmul": matmul},
        "bf16_gemm": matmul_ops.native_kernel(torch.bfloat16),
        "variants": per,
        "probe_gflops": rates,
        "load_after": os.getloadavg()[0],
    }  # fmt: skip
    tag = "" if matmul == "auto" else f"_matmul-{matmul}"
    # one file per set of variants: runs of other variants on the same shape are kept beside it
    name = f"{shape}_s{seq}_r{rank}_{dtype}{tag}_{'+'.join(names).replace(':', '-')}.json"
    return write_row(out / "rows" / "speed" / name, row, line, "speed")


def paired(row: Row, a: str, b: str) -> float | None:
    """Median over rounds of step time a / step time b (names 'variant:dtype', or a bare
    variant in the row's dtype); None when either is missing."""
    v = row["variants"]
    a, b = _named(row, a), _named(row, b)
    if a not in v or b not in v:
        return None
    return statistics.median(x / y for x, y in zip(v[a]["steps_s"], v[b]["steps_s"], strict=True))


def _named(row: Row, x: str) -> str:
    return x if ":" in x else f"{x}:{row['config']['dtype']}"


def best_pair(rows: list[Row], a: str, b: str) -> float | None:
    """`paired` from the row, among `rows`, that has both a and b and the most rounds."""
    both = [r for r in rows if {_named(r, a), _named(r, b)} <= set(r["variants"])]
    if not both:
        return None
    return paired(max(both, key=lambda r: r["config"]["rounds"]), a, b)


def best_variant(rows: list[Row], a: str) -> tuple[Row, dict[str, Any]] | None:
    """(row, its entry for a) from the row, among `rows`, that has a and the most rounds."""
    has = [r for r in rows if _named(r, a) in r["variants"]]
    if not has:
        return None
    r = max(has, key=lambda r: r["config"]["rounds"])
    return r, r["variants"][_named(r, a)]


def line(r: Row) -> str:
    c, ref = r["config"], r["config"]["variants"][0]
    parts = [
        f"{n} {v['median_s']:.3g} s ({v['floor_ratio']:.2f}x floor"
        + ("" if n == ref else f", {paired(r, n, ref):.2f}x {ref}'s time")  # type: ignore[str-format]
        + ")"
        for n, v in r["variants"].items()
    ]
    return f"{c['shape']} s{c['seq']} r{c['rank']}, {c['rounds']} rounds: " + "; ".join(parts)


def _bf16_path(r: Row) -> str:
    """', bf16 matmuls: …' where the row has a bf16 variant."""
    if not any(n.endswith((":bfloat16", ":float16")) for n in r["config"]["variants"]):
        return ""
    m, native = r["config"].get("matmul", "auto"), r.get("bf16_gemm")
    if m == "fp32" or (m == "auto" and native is False):
        forced = " (forced: this CPU has a bf16 GEMM)" if native else ""
        return ", bf16 matmuls computed in fp32, stored bf16" + forced
    return ", bf16 matmuls on the CPU's native bf16 GEMM"


def section(rows: list[Row]) -> list[str]:
    ok = [r for r in rows if r.get("table") == "speed" and r.get("status") == "ok"]
    if not ok:
        return []
    lines = [
        "## Step time side by side (`mesp bench speed`)",
        "",
        "Every variant built in one process and run in rounds: each round probes the GEMM rate, "
        "then runs one step of each variant (the order rotated by round). Ratios are taken "
        "inside a round, between steps seconds apart, and the median over rounds is shown "
        "(min–max beside it), so the machine's drift, which moves whole minutes by ±20% here, "
        "cancels out of them; floor: each step against 6·N·T at its own round's probed rate.",
        "",
    ]
    for r in ok:
        c = r["config"]
        ref = c["variants"][0]
        rates = ", ".join(f"{k} {min(v):.0f}–{max(v):.0f}" for k, v in r["probe_gflops"].items())
        lines += [
            f"`{r['command']}` — {c['shape']}, seq {c['seq']}, rank {c['rank']}, "
            f"{c['rounds']} rounds, {c['threads']} threads{_bf16_path(r)}; "
            f"probed GFLOP/s: {rates}.",
            "",
            f"| variant | median s/step (tokens/s) | time / {ref}'s, per round: median (min–max) "
            "| step / floor: median (min–max) |",
            "|---|---|---|---|",
        ]
        for n, v in r["variants"].items():
            steps = r["variants"][ref]["steps_s"]
            pr = [x / y for x, y in zip(v["steps_s"], steps, strict=True)]
            rel = "1" if n == ref else f"{statistics.median(pr):.3f} ({min(pr):.2f}–{max(pr):.2f})"
            fr = v["floor_ratios"]
            lines.append(
                f"| {n} | {v['median_s']:.3g} ({v['tokens_per_s']:.3g}) | {rel} | "
                f"{statistics.median(fr):.2f} ({min(fr):.2f}–{max(fr):.2f}) |"
            )
        lines.append("")
    return lines


__all__ = ["best_pair", "best_variant", "line", "paired", "parse_variant", "run_speed", "section"]
