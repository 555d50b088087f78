"""`mesp bench ladder | softmax | dequant | dropin`: the benchmarks beyond the paper's tables,
each flags -> its options and the canonical command that reproduces it (for the report)."""

from __future__ import annotations

import argparse
import itertools
import shlex
from collections.abc import Callable, Iterable
from typing import Any

from mesp.errors import MespError


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


def run_ladder(ns: argparse.Namespace) -> int:
    from mesp.bench.ladder import LadderOptions, line, run_ladder

    if not 0.0 < ns.fraction <= 1.0:
        raise MespError(f"--fraction must be in (0, 1], got {ns.fraction}")
    opts = LadderOptions(device=ns.device, dtype=ns.dtype, fraction=ns.fraction, out=ns.out)
    opts.shape = (ns.shapes or (opts.shape,))[0]
    opts.seqs = ns.seq or opts.seqs
    opts.rungs, opts.timeout, opts.threads = ns.rungs, ns.timeout, ns.threads
    parts = ["mesp", "bench", "ladder", "--shapes", opts.shape, "--device", ns.device]
    parts += ["--seq", ",".join(map(str, opts.seqs)), "--dtype", ns.dtype]
    if ns.rungs:
        parts += ["--rungs", ",".join(ns.rungs)]
    parts += ["--fraction", str(ns.fraction), "--out", str(ns.out)]
    if ns.markdown:
        parts += ["--markdown", str(ns.markdown)]
    opts.command = shlex.join(parts)
    return measure_then_report(ns, lambda: run_ladder(opts), line, mkdir=True)


def run_softmax(ns: argparse.Namespace) -> int:
    from mesp.bench.softmax import SoftmaxConfig, line, run_softmax

    if ns.train_steps < 1 or ns.vocab_subset < 1:
        raise MespError("--train-steps and --vocab-subset must be positive")
    seq = (ns.seq or (128,))[0]
    models = tuple(ns.models or ("smollm2", "gemma3-270m"))
    base = SoftmaxConfig(
        model="", loss="ce", steps=ns.train_steps, seq=seq, vocab_subset=ns.vocab_subset
    )
    cmd = shlex.join(
        [
            *("mesp", "bench", "softmax", "--models", ",".join(models)),
            *("--train-steps", str(ns.train_steps), "--seq", str(seq)),
            *("--vocab-subset", str(ns.vocab_subset), "--out", str(ns.out)),
            *(["--markdown", str(ns.markdown)] if ns.markdown else []),
        ]
    )
    return measure_then_report(ns, lambda: run_softmax(models, base, ns.out, ns.timeout, cmd), line)


def run_dequant(ns: argparse.Namespace) -> int:
    from mesp.bench.dequant import line, run_dequant

    if ns.steps < 1 or ns.warmup < 0:
        raise MespError("--steps must be >= 1 and --warmup >= 0")
    parts = ["mesp", "bench", "dequant", "--steps", str(ns.steps), "--warmup", str(ns.warmup)]
    if ns.threads:
        parts += ["--threads", str(ns.threads)]
    parts += ["--out", str(ns.out)] + (["--markdown", str(ns.markdown)] if ns.markdown else [])
    cmd = shlex.join(parts)
    return measure_then_report(
        ns, lambda: run_dequant(ns.out, ns.steps, ns.warmup, ns.threads, cmd), line
    )


def run_dpo(ns: argparse.Namespace) -> int:
    """A DPO step beside SFT on the same tokens, mesp and HF + PEFT + gc (mesp/bench/dpo.py):
    one --shapes / --seq (per sequence) / --rank, --steps rounds after --warmup steps each;
    --engines picks among the variants (mesp-sft and mesp-dpo always)."""
    from mesp.bench.dpo import VARIANTS, line, run_dpo

    variants = tuple(ns.engines) if ns.engines else VARIANTS
    shape = (ns.shapes or ("qwen2.5-0.5b",))[0]
    seq, rank = (ns.seq or (256,))[0], (ns.rank or (8,))[0]
    if len(ns.shapes or ()) > 1 or len(ns.seq or ()) > 1 or len(ns.rank or ()) > 1:
        raise MespError("dpo: one --shapes, --seq and --rank at a time")
    parts = ["mesp", "bench", "dpo", "--shapes", shape, "--seq", str(seq), "--rank", str(rank)]
    parts += ["--engines", ",".join(variants)] if ns.engines else []
    parts += ["--dtype", ns.dtype, "--steps", str(ns.steps), "--warmup", str(ns.warmup)]
    parts += ["--threads", str(ns.threads)] if ns.threads else []
    parts += ["--out", str(ns.out)] + (["--markdown", str(ns.markdown)] if ns.markdown else [])
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    cmd = shlex.join(parts)
    return measure_then_report(
        ns,
        lambda: run_dpo(ns.out, shape, seq, rank, ns.dtype, ns.steps, ns.warmup, cmd, variants),
        line,
    )


def run_speed(ns: argparse.Namespace) -> int:
    """Variants' step times side by side in one process (mesp/bench/speed.py): --engines
    (the first is the reference of the ratios; `name:dtype` for a dtype of its own), one
    --shapes / --seq / --rank configuration, --steps rounds after --warmup steps each."""
    from mesp.bench.speed import line, run_speed

    variants = tuple(ns.engines) if ns.engines else ("mesp", "peft-gc", "mesp-fp", "mebp")
    shape = (ns.shapes or ("qwen2.5-0.5b",))[0]
    seq, rank = (ns.seq or (256,))[0], (ns.rank or (8,))[0]
    if len(ns.shapes or ()) > 1 or len(ns.seq or ()) > 1 or len(ns.rank or ()) > 1:
        raise MespError("speed: one --shapes, --seq and --rank at a time")
    parts = ["mesp", "bench", "speed", "--engines", ",".join(variants), "--shapes", shape]
    parts += ["--seq", str(seq), "--rank", str(rank), "--dtype", ns.dtype]
    parts += ["--steps", str(ns.steps), "--warmup", str(ns.warmup), "--out", str(ns.out)]
    parts += [] if ns.matmul == "auto" else ["--matmul", ns.matmul]
    parts += ["--markdown", str(ns.markdown)] if ns.markdown else []
    cmd = shlex.join(parts)
    return measure_then_report(
        ns,
        lambda: run_speed(
            ns.out, shape, seq, rank, ns.dtype, variants, ns.steps, ns.warmup, cmd, ns.matmul
        ),
        line,
    )


def run_profile(ns: argparse.Namespace) -> int:
    """Where a step's time goes (mesp/bench/profile.py): each --engines entry (mesp, mebp, bp;
    a -fp suffix: the fp32/bf16 base instead of 4-bit g64) on each --shapes, one profiled step
    after --warmup and --steps plain ones."""
    from mesp.bench.profile import line, run_profile

    if ns.steps < 1 or ns.warmup < 0:
        raise MespError("--steps must be >= 1 and --warmup >= 0")
    variants = tuple(ns.engines) if ns.engines else ("mesp", "mesp-fp")
    shapes = tuple(ns.shapes) if ns.shapes else ("qwen2.5-0.5b",)
    engines = []
    for v in variants:
        e = v.removesuffix("-fp")
        if e not in ("mesp", "mebp", "bp"):
            raise MespError(f"profile: --engines takes mesp, mebp, bp (optionally -fp), got {v!r}")
        engines.append((e, None if v.endswith("-fp") else 4))
    parts = ["mesp", "bench", "profile", "--engines", ",".join(variants)]
    parts += ["--shapes", ",".join(shapes), "--dtype", ns.dtype, "--steps", str(ns.steps)]
    parts += ["--warmup", str(ns.warmup), "--out", str(ns.out)]
    parts += ["--markdown", str(ns.markdown)] if ns.markdown else []
    cmd = shlex.join(parts)

    def measure() -> list:
        from mesp.bench.variants import shape_dict

        rows = []
        for shape in shapes:
            shape_dict(shape)  # an unknown shape: one line, before anything runs
            for e, bits in engines:
                rows += run_profile(ns.out, e, shape, ns.dtype, bits, ns.steps, ns.warmup, cmd)
        return rows

    return measure_then_report(ns, measure, line)


def run_decode(ns: argparse.Namespace) -> int:
    """The int4 decode kernel against dequantize + matmul (mesp/bench/decode.py): per layer,
    and `mesp generate` on each --models entry (default smollm2) for --decode-tokens tokens."""
    from mesp.bench.decode import line, run_decode

    if ns.steps < 1 or ns.warmup < 0 or ns.decode_tokens < 1:
        raise MespError("--steps and --decode-tokens must be >= 1 and --warmup >= 0")
    models = tuple(ns.models) if ns.models else ("smollm2",)
    parts = ["mesp", "bench", "decode", "--models", ",".join(models)]
    parts += ["--decode-tokens", str(ns.decode_tokens), "--steps", str(ns.steps)]
    parts += ["--warmup", str(ns.warmup), "--out", str(ns.out)]
    parts += ["--markdown", str(ns.markdown)] if ns.markdown else []
    cmd = shlex.join(parts)
    return measure_then_report(
        ns, lambda: run_decode(ns.out, models, ns.decode_tokens, ns.steps, ns.warmup, cmd), line
    )


def run_ondevice(ns: argparse.Namespace) -> int:
    """The native ExecuTorch runner against the in-process engine (mesp/bench/ondevice.py):
    one row per --shapes (random weights) and --models (real GGUF models) entry, for each --seq
    and --rank given, --steps + 1 steps."""
    from mesp.bench.ondevice import OndeviceConfig, line, run_ondevice

    if ns.steps < 1:
        raise MespError("--steps must be >= 1")
    models = tuple(ns.models or ())
    shapes = ns.shapes or (() if models else ("qwen2.5-0.5b",))
    seqs, ranks = ns.seq or (256,), ns.rank or (8,)
    parts = ["mesp", "bench", "ondevice"]
    parts += ["--shapes", ",".join(shapes)] if shapes else []
    parts += ["--models", ",".join(models)] if models else []
    parts += ["--seq", ",".join(map(str, seqs)), "--rank", ",".join(map(str, ranks))]
    parts += ["--steps", str(ns.steps), "--out", str(ns.out)]
    if ns.memory_cap is not None and ns.memory_cap <= 0:
        raise MespError(f"--memory-cap must be a positive number of MB, got {ns.memory_cap:g}")
    capped = ns.memory_cap is not None or ns.find_cap
    if ns.memory_cap is not None:
        parts += ["--memory-cap", f"{ns.memory_cap:g}"]
    if ns.find_cap:
        parts.append("--find-cap")
    if ns.weight_block_kb < 0:
        raise MespError("--weight-block-kb must be 0 (whole matrices) or positive")
    if ns.weight_block_kb:
        parts += ["--weight-block-kb", str(ns.weight_block_kb)]
    if ns.checkpoints_on_disk:
        parts.append("--checkpoints-on-disk")
    cmd = shlex.join(parts + (["--markdown", str(ns.markdown)] if ns.markdown else []))

    def measure() -> list[dict[str, Any]]:
        from mesp.bench.ondevice_cap import run_caps

        rows = []
        what = [(s, None) for s in shapes] + [("qwen2.5-0.5b", m) for m in models]
        for (shape, model), seq, rank in itertools.product(what, seqs, ranks):
            c = OndeviceConfig(
                shape=shape, model=model, seq=seq, rank=rank, steps=ns.steps + 1,
                weight_block_kb=ns.weight_block_kb, checkpoints_on_disk=ns.checkpoints_on_disk,
            )  # fmt: skip
            if capped:
                rows += run_caps(ns.out, c, cmd, ns.memory_cap, ns.find_cap, ns.timeout)
            else:
                rows += run_ondevice(ns.out, c, cmd, ns.timeout)
        return rows

    if capped:
        from mesp.bench.ondevice_cap import line as cap_line

        return measure_then_report(ns, measure, cap_line)
    return measure_then_report(ns, measure, line)


def run_dropin(ns: argparse.Namespace) -> int:
    """HF + PEFT, unpatched vs mesp.patch, gradient checkpointing off/on (mesp/bench/dropin.py).
    --quick: the tiny Qwen2 shape at 32 and 64 tokens (seconds, for the tests). --device meta:
    the exact peak on the meta device (no arithmetic, no time), for lengths a CPU cannot run."""
    from mesp.bench import dropin as dropin_bench

    if ns.steps < 1 or ns.warmup < 0:
        raise MespError("--steps must be >= 1 and --warmup >= 0")
    dtype, device = ns.dtype or "float32", ns.device or "cpu"
    shape = (ns.shapes or ("tiny-qwen2" if ns.quick else "qwen2.5-0.5b",))[0]
    seqs = ns.seq or ((32, 64) if ns.quick else (256, 1024))
    rank = (ns.rank or (8,))[0]
    if ns.quick and ns.threads is None:
        ns.threads = 1
    parts = ["mesp", "bench", "dropin", "--shapes", shape, "--seq", ",".join(map(str, seqs))]
    parts += ["--rank", str(rank), "--dtype", dtype, "--steps", str(ns.steps)]
    parts += ["--warmup", str(ns.warmup)]
    if ns.threads:
        parts += ["--threads", str(ns.threads)]
    if ns.skip:
        parts += ["--skip", ",".join(ns.skip)]
    if device == "meta":
        parts += ["--device", "meta"]
    parts += ["--out", str(ns.out)] + (["--markdown", str(ns.markdown)] if ns.markdown else [])
    cmd = shlex.join(parts)
    return measure_then_report(
        ns,
        lambda: dropin_bench.run(
            tuple(seqs),
            shape,
            dtype,
            ns.steps,
            ns.threads,
            timeout=ns.timeout,
            rank=rank,
            warmup=ns.warmup,
            out=ns.out,
            command=cmd,
            skip=tuple(ns.skip),
            device=device,
        ),  # fmt: skip
        dropin_bench.line,
    )
