"""`mesp bench {table1,...,ladder,softmax,dequant,decode,dropin,ondevice,profile,speed,dpo}`: flags
to the benchmarks.

`quick` is table 1 on a tiny 2-layer shape (about a minute; what the tests run); `--quick`
does the same for any table. Rows accumulate under --out, so tables can be run piece by piece
(e.g. one --shapes at a time) and --markdown rebuilds the report from all of them.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from mesp.cli import bench_studies
from mesp.cli.bench_studies import measure_then_report
from mesp.errors import MespError

TABLE_CHOICES = (
    "table1",
    "table2",
    "table3",
    "table5",
    "offload",
    "budget",
    "quick",
    "ladder",
    "softmax",
    "dequant",
    "decode",
    "dropin",
    "ondevice",
    "profile",
    "speed",
    "dpo",
)
DTYPES = ("bfloat16", "float32", "float16")


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(w) for w in _words(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 4,8,16; got {text!r}") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from mesp.bench.tables import VARIANTS

    p = subparsers.add_parser(
        "bench",
        help="the paper's memory/time tables, each configuration in its own process",
        description=__doc__,
    )
    p.add_argument("table", choices=TABLE_CHOICES, help="which table (quick: tiny table 1)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, about a minute")
    p.add_argument(
        "--engines",
        type=_words,
        default=None,
        help=f"comma list of variants to run ({', '.join(VARIANTS)}); the table's others "
        "are recorded as skipped",
    )
    p.add_argument("--shapes", type=_words, default=None, help="e.g. qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--seq", type=_ints, default=None, help="sequence length(s), comma list")
    p.add_argument("--rank", type=_ints, default=None, help="LoRA rank(s), comma list")
    p.add_argument(
        "--skip",
        type=_words,
        default=(),
        help="configs not to run, e.g. bp@qwen2.5-3b or mebp@qwen2.5-0.5b@4096 "
        "(dropin: unpatched, unpatched+gc, patched, patched+gc, optionally @SEQ)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="compute dtype (default: float32 where the CPU has no native bf16 GEMM, else "
        "bfloat16, the report's headline dtype; ladder: float32, as its paper)",
    )
    p.add_argument(
        "--device",
        choices=("meta", "cpu"),
        default=None,
        help="exact peak on the meta device (shapes, no arithmetic; no RSS or time) or real "
        "CPU runs (default: meta for the ladder, cpu for the tables)",
    )
    p.add_argument("--fraction", type=float, default=0.3, help="ladder: share of positions trained")
    p.add_argument("--rungs", type=_words, default=None, help="ladder: rungs to run (default: all)")
    p.add_argument(
        "--models",
        type=_words,
        default=None,
        help="real models (named models or paths): softmax (default smollm2,gemma3-270m), "
        "decode (default smollm2), ondevice (GGUF files, e.g. qwen2.5-coder-0.5b)",
    )
    p.add_argument("--decode-tokens", type=int, default=64, help="decode: new tokens per run")
    p.add_argument("--train-steps", type=int, default=30, help="softmax: steps per run")
    p.add_argument("--vocab-subset", type=int, default=1000, help="softmax: K")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument(
        "--rss-steps",
        type=int,
        default=1,
        help="tables: untracked steps of the memory child whose RSS rise is measured (the "
        "time child runs --steps, without the RSS malloc setting)",
    )
    p.add_argument(
        "--memory-cap",
        type=float,
        default=None,
        help="ondevice: run the native runner inside a memory cgroup of this many MB (no swap)",
    )
    p.add_argument(
        "--find-cap",
        action="store_true",
        help="ondevice: bisect (to 8 MB) the smallest cap in which 3 steps complete, for the "
        "native runner and for mesp train",
    )
    p.add_argument(
        "--weight-block-kb",
        type=int,
        default=0,
        help="ondevice: export with mesp export --weight-block-kb KB (0: whole matrices)",
    )
    p.add_argument(
        "--checkpoints-on-disk",
        action="store_true",
        help="ondevice: the native runner keeps the block inputs in a scratch file "
        "(--checkpoints-dir) instead of in memory",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument(
        "--matmul",
        choices=("auto", "native", "fp32"),
        default="auto",
        help="bf16 matmuls (MESP_BF16_MATMUL): auto computes them in fp32 where the CPU lacks "
        "a native bf16 GEMM, as mesp train does",
    )
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="JSON rows + PNGs")
    p.add_argument("--markdown", type=Path, default=None, help="(re)write this report")
    p.add_argument(
        "--report-only", action="store_true", help="no measurement: rebuild plots and report"
    )
    return p


def command_line(ns: argparse.Namespace) -> str:
    """The canonical command that reproduces this run, for the report."""
    parts = ["mesp", "bench", ns.table]
    if ns.quick:
        parts.append("--quick")
    for flag, val in (("--engines", ns.engines), ("--shapes", ns.shapes), ("--skip", ns.skip)):
        if val:
            parts += [flag, ",".join(val)]
    for flag, val in (("--seq", ns.seq), ("--rank", ns.rank)):
        if val:
            parts += [flag, ",".join(map(str, val))]
    parts += ["--dtype", ns.dtype, "--steps", str(ns.steps), "--warmup", str(ns.warmup)]
    if getattr(ns, "rss_steps", 1) != 1:
        parts += ["--rss-steps", str(ns.rss_steps)]
    if ns.threads:
        parts += ["--threads", str(ns.threads)]
    if ns.matmul != "auto":
        parts += ["--matmul", ns.matmul]
    if ns.device == "meta":
        parts += ["--device", "meta"]
    parts += ["--out", str(ns.out)]
    if ns.markdown:
        parts += ["--markdown", str(ns.markdown)]
    return shlex.join(parts)


def run(ns: argparse.Namespace) -> int:
    from mesp.bench.tables import BenchOptions, run_table, summary
    from mesp.bench.targets import cpu_dtype

    ondevice_only = (
        ns.memory_cap is not None,
        ns.find_cap,
        ns.weight_block_kb,
        ns.checkpoints_on_disk,
    )
    if ns.table != "ondevice" and any(ondevice_only):
        raise MespError(
            "--memory-cap, --find-cap, --weight-block-kb, --checkpoints-on-disk are for mesp "
            "bench ondevice"
        )
    if ns.table == "dropin":
        return bench_studies.run_dropin(ns)
    if ns.table == "dequant":
        return bench_studies.run_dequant(ns)
    if ns.table == "decode":
        return bench_studies.run_decode(ns)
    if ns.table == "ondevice":
        return bench_studies.run_ondevice(ns)
    if ns.table == "dpo":
        ns.dtype = ns.dtype or cpu_dtype()
        return bench_studies.run_dpo(ns)
    if ns.table in ("profile", "speed"):  # each checks its own --steps / --warmup
        ns.dtype = ns.dtype or cpu_dtype()
        run_study = bench_studies.run_profile if ns.table == "profile" else bench_studies.run_speed
        return run_study(ns)
    if ns.table == "softmax":
        return bench_studies.run_softmax(ns)
    if ns.table == "ladder":
        ns.dtype, ns.device = ns.dtype or "float32", ns.device or "meta"
        return bench_studies.run_ladder(ns)
    ns.dtype, ns.device = ns.dtype or cpu_dtype(), ns.device or "cpu"

    if ns.steps < 1 or ns.warmup < 0 or ns.rss_steps < 1:
        raise MespError("--steps and --rss-steps must be >= 1 and --warmup >= 0")
    quick = ns.quick or ns.table == "quick"
    table = "table1" if ns.table == "quick" else ns.table
    if quick and ns.threads is None:
        ns.threads = 1  # tiny ops: a second thread only adds sync overhead on a busy machine
    opts = BenchOptions(
        quick=quick,
        engines=ns.engines,
        shapes=ns.shapes,
        seqs=ns.seq,
        ranks=ns.rank,
        skip=tuple(ns.skip),
        dtype=ns.dtype,
        steps=ns.steps,
        rss_steps=ns.rss_steps,
        warmup=ns.warmup,
        timeout=ns.timeout,
        threads=ns.threads,
        matmul=ns.matmul,
        device=ns.device,
        out=ns.out,
        command=command_line(ns),
    )
    return measure_then_report(ns, lambda: run_table(table, opts), summary, mkdir=True)


__all__ = ["add_parser", "run"]
