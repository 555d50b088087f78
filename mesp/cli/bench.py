"""`mesp bench <name>`: one subcommand per benchmark, each with only the flags it reads.

Rows accumulate under --out, so a benchmark can be run piece by piece (e.g. one --shapes at a
time) and --markdown rebuilds the report from all of them. `quick` is table 1 on a tiny 2-layer
shape (about a minute; what the tests run).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mesp.cli import bench_studies as studies
from mesp.cli.bench_flags import add_flags


@dataclass(frozen=True)
class Bench:
    help: str
    flags: tuple[str, ...]
    run: Callable[[argparse.Namespace], int]
    helps: dict[str, str] = field(default_factory=dict)  # this benchmark's words for a flag


_TABLE = ("engines", "shapes", "seq", "rank", "skip", "dtype", "device")
_TABLE += ("steps", "warmup", "rss_steps", "threads", "matmul")
_ENGINES = "comma list of variants ({}); the table's others are recorded as skipped"


def _table(what: str) -> Bench:
    return Bench(what, ("quick", *_TABLE), studies.run_tables, {"device": "(default: cpu)"})


BENCHES: dict[str, Bench] = {
    "table1": _table("the paper's Table 1: peak memory and step time per engine and shape"),
    "table2": _table("the paper's Table 2: memory against sequence length"),
    "table3": _table("the paper's Table 3: memory against LoRA rank"),
    "table5": _table("the paper's Table 5: memory by model size"),
    "offload": _table("checkpoints offloaded to disk against kept in memory"),
    "budget": _table("budget-aware recompute (--max-memory) against recompute everything"),
    "quick": Bench("table 1 on a tiny 2-layer shape (about a minute)", _TABLE, studies.run_tables),
    "ladder": Bench(
        "the memory ladder: each technique's exact peak, rung by rung, long sequences",
        ("shapes", "seq", "dtype", "device", "fraction", "rungs", "threads"),
        studies.run_ladder,
        {
            "shapes": "one shape (default qwen2.5-3b)",
            "dtype": "compute dtype (default float32, as its paper)",
            "device": "(default: meta)",
        },
    ),
    "softmax": Bench(
        "vocabulary-subset softmax against the full loss on real models",
        ("models", "seq", "train_steps", "vocab_subset"),
        studies.run_softmax,
        {"models": "real models (default smollm2,gemma3-270m)", "seq": "one length (128)"},
    ),
    "dequant": Bench(
        "the native dequantizer against torch's ops",
        ("steps", "warmup", "threads"),
        studies.run_dequant,
    ),
    "decode": Bench(
        "the int4 decode kernel against dequantize + matmul, and mesp generate",
        ("models", "decode_tokens", "steps", "warmup"),
        studies.run_decode,
        {"models": "real models (default smollm2)"},
    ),
    "dropin": Bench(
        "HF + PEFT, unpatched against mesp.patch, gradient checkpointing off and on",
        ("quick", "shapes", "seq", "rank", "dtype", "device", "steps", "warmup", "threads", "skip"),
        studies.run_dropin,
        {
            "skip": "configs not to run: unpatched, unpatched+gc, patched, patched+gc, "
            "optionally @SEQ",
            "quick": "the tiny Qwen2 shape at 32 and 64 tokens (seconds)",
        },
    ),
    "ondevice": Bench(
        "the native ExecuTorch runner against the in-process engine: peak memory, step time",
        ("shapes", "models", "seq", "rank", "steps", "memory_cap", "find_cap", "weight_block_kb")
        + ("checkpoints_on_disk", "dp", "checkpoint_dtype"),
        studies.run_ondevice,
        {
            "models": "real GGUF models, e.g. qwen2.5-coder-0.5b",
            "shapes": "random weights at these shapes (default qwen2.5-0.5b without --models)",
            "steps": "timed steps (one more runs first)",
        },
    ),
    "profile": Bench(
        "where a step's time goes, by kind of work (torch.profiler)",
        ("engines", "shapes", "dtype", "steps", "warmup"),
        studies.run_profile,
        {"engines": "mesp, mebp, bp, each optionally -fp (default mesp,mesp-fp)"},
    ),
    "speed": Bench(
        "engines' step times side by side in one process (the time targets)",
        ("engines", "shapes", "seq", "rank", "dtype", "steps", "warmup", "matmul"),
        studies.run_speed,
        {"engines": "variants, the first the ratios' reference (name:dtype for its own)"},
    ),
    "dpo": Bench(
        "a DPO step beside SFT on the same tokens, mesp and HF + PEFT + checkpointing",
        ("engines", "shapes", "seq", "rank", "dtype", "steps", "warmup", "threads"),
        studies.run_dpo,
    ),
    "dp": Bench(
        "a DP-SGD step (per-layer, flat) beside SFT, mesp and HF + PEFT + Opacus",
        ("engines", "shapes", "seq", "rank", "batch", "dtype", "steps", "warmup", "threads"),
        studies.run_dp,
    ),
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from mesp.bench.tables import VARIANTS

    p = subparsers.add_parser(
        "bench",
        help="the paper's memory/time tables and mesp's own benchmarks, each in fresh processes",
        description=__doc__,
    )
    sub = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, b in BENCHES.items():
        helps = dict(b.helps)
        if b.run is studies.run_tables:
            helps.setdefault("engines", _ENGINES.format(", ".join(VARIANTS)))
        s = sub.add_parser(name, help=b.help, description=b.help)
        add_flags(s, b.flags, helps)
    return p


def run(ns: argparse.Namespace) -> int:
    return BENCHES[ns.bench].run(ns)


__all__ = ["BENCHES", "add_parser", "run"]
