"""The flags of `mesp bench <name>`: each defined once here, each benchmark taking only the ones
it reads (mesp/cli/bench.py lists them), and the canonical command of a row derived from the
parsed flags (`canonical`), so a report always shows a command that reproduces it."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mesp.errors import MespError

DTYPES = ("bfloat16", "float32", "float16")


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(w) for w in _words(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 4,8,16; got {text!r}") from None


# name -> (add_argument keywords); "help" may be replaced per benchmark (Bench.helps)
FLAGS: dict[str, dict[str, Any]] = {
    "quick": dict(action="store_true", help="tiny shapes, about a minute"),
    "engines": dict(type=_words, default=None, help="comma list of variants to run"),
    "shapes": dict(type=_words, default=None, help="e.g. qwen2.5-0.5b,qwen2.5-1.5b"),
    "models": dict(type=_words, default=None, help="real models (named models or paths)"),
    "seq": dict(type=_ints, default=None, help="sequence length(s), comma list"),
    "rank": dict(type=_ints, default=None, help="LoRA rank(s), comma list"),
    "batch": dict(type=int, default=4, help="rows per step"),
    "skip": dict(type=_words, default=(), help="configs not to run, e.g. bp@qwen2.5-3b"),
    "dtype": dict(
        choices=DTYPES,
        default=None,
        help="compute dtype (default: float32 where the CPU has no native bf16 GEMM, else "
        "bfloat16, the report's headline dtype)",
    ),
    "device": dict(
        choices=("meta", "cpu"),
        default=None,
        help="exact peak on the meta device (shapes, no arithmetic; no RSS or time) or real "
        "CPU runs",
    ),
    "fraction": dict(type=float, default=0.3, help="share of positions trained"),
    "rungs": dict(type=_words, default=None, help="rungs to run (default: all)"),
    "decode_tokens": dict(type=int, default=64, help="new tokens per run"),
    "train_steps": dict(type=int, default=30, help="training steps per run"),
    "vocab_subset": dict(type=int, default=1000, help="K, the sampled vocabulary"),
    "steps": dict(type=int, default=3, help="timed steps (median reported)"),
    "warmup": dict(type=int, default=1, help="untimed steps first"),
    "rss_steps": dict(
        type=int,
        default=1,
        help="untracked steps of the memory child whose RSS rise is measured (the time child "
        "runs --steps, without the RSS malloc setting)",
    ),
    "memory_cap": dict(
        type=float,
        default=None,
        help="run the native runner inside a memory cgroup of this many MB (no swap)",
    ),
    "find_cap": dict(
        action="store_true",
        help="bisect (to 8 MB) the smallest cap in which 3 steps complete, for the native "
        "runner and for mesp train",
    ),
    "weight_block_kb": dict(
        type=int, default=0, help="export with mesp export --weight-block-kb KB (0: whole)"
    ),
    "checkpoints_on_disk": dict(
        action="store_true",
        help="the native runner keeps the block inputs in a scratch file (--checkpoints-dir) "
        "instead of in memory",
    ),
    "dp": dict(
        type=_words,
        default=(),
        help="also run the native runner under DP-SGD with these clippings (per-layer, flat): "
        "C 1, σ 1, every row each step (q = 1), a row each beside the plain run",
    ),
    "checkpoint_dtype": dict(
        type=_words,
        default=(),
        help="also run the native runner with the block inputs kept in these dtypes (float16, "
        "bfloat16), a row each beside the plain run, with the adapter's difference from it",
    ),
    "threads": dict(type=int, default=None, help="torch threads (default: all)"),
    "matmul": dict(
        choices=("auto", "native", "fp32"),
        default="auto",
        help="bf16 matmuls (MESP_BF16_MATMUL): auto computes them in fp32 where the CPU lacks "
        "a native bf16 GEMM, as mesp train does",
    ),
    # every benchmark's own
    "timeout": dict(type=float, default=3600.0, help="seconds per configuration"),
    "out": dict(type=Path, default=Path("bench_results"), help="JSON rows + PNGs"),
    "markdown": dict(type=Path, default=None, help="(re)write this report"),
    "report_only": dict(action="store_true", help="no measurement: rebuild plots and report"),
}
COMMON = ("timeout", "out", "markdown", "report_only")
_NOT_IN_COMMAND = ("timeout", "report_only")  # how it is run, not what it measures


def add_flags(p: argparse.ArgumentParser, names: tuple[str, ...], helps: dict[str, str]) -> None:
    """Add `names` (then the common flags) to p, in that order; the order of `canonical`."""
    for name in (*names, *COMMON):
        kw = dict(FLAGS[name])
        kw["help"] = helps.get(name, kw["help"])
        p.add_argument("--" + name.replace("_", "-"), **kw)
    p.set_defaults(bench_flags=(*names, *COMMON))


def _text(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def canonical(ns: argparse.Namespace) -> str:
    """`mesp bench NAME …` as the benchmark ran it: every flag whose value (defaults the
    benchmark resolved included) differs from the flag's default, and --out."""
    parts = ["mesp", "bench", ns.bench]
    for name in ns.bench_flags:
        value, default = getattr(ns, name), FLAGS[name].get("default")
        # `is`, not `in`: 0 == False, and --warmup 0 must stay in the command
        if name in _NOT_IN_COMMAND or value is None or value is False or value == ():
            continue
        if value == default and name != "out":
            continue
        flag = "--" + name.replace("_", "-")
        parts += [flag] if value is True else [flag, _text(value)]
    return shlex.join(parts)


def measure_then_report(
    ns: argparse.Namespace,
    measure: Callable[[], Iterable[dict[str, Any]]],
    line: Callable[[dict[str, Any]], str],
    dtype: str | None = None,
    mkdir: bool = False,
) -> int:
    """Measure (unless --report-only), one line per row; then, with --markdown, rebuild the
    report from every row under --out (headline dtype: `dtype`, or the rows' own, see
    mesp.bench.targets.headline_dtype)."""
    from mesp.bench.report import write_report

    if not ns.report_only:
        if mkdir:
            ns.out.mkdir(parents=True, exist_ok=True)
        for row in measure():
            print(line(row))
    if ns.markdown is not None:
        print(f"wrote {write_report(ns.out, ns.markdown, dtype)}")
    return 0


def check_steps(ns: argparse.Namespace) -> None:
    if ns.steps < 1 or ns.warmup < 0:
        raise MespError("--steps must be >= 1 and --warmup >= 0")


def one_config(ns: argparse.Namespace, what: str, shape: str, seq: int, rank: int) -> tuple:
    """One --shapes / --seq / --rank configuration (these defaults), resolved into ns."""
    if len(ns.shapes or ()) > 1 or len(ns.seq or ()) > 1 or len(ns.rank or ()) > 1:
        raise MespError(f"{what}: one --shapes, --seq and --rank at a time")
    ns.shapes, ns.seq, ns.rank = ns.shapes or (shape,), ns.seq or (seq,), ns.rank or (rank,)
    return ns.shapes[0], ns.seq[0], ns.rank[0]
