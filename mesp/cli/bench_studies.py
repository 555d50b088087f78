"""What `mesp bench <name>` runs: each benchmark's flags -> its options (defaults resolved into
the namespace, so `canonical` records the command that reproduces the rows), then measure and
report."""

from __future__ import annotations

import argparse
import itertools
from functools import partial
from typing import Any

from mesp.cli.bench_flags import canonical, check_steps, measure_then_report, one_config
from mesp.errors import MespError


def run_tables(ns: argparse.Namespace) -> int:
    """The paper's tables (mesp/bench/tables.py); `quick` is table 1 on a tiny shape."""
    from mesp.bench.tables import BenchOptions, run_table, summary
    from mesp.bench.targets import cpu_dtype

    ns.dtype, ns.device = ns.dtype or cpu_dtype(), ns.device or "cpu"
    check_steps(ns)
    if ns.rss_steps < 1:
        raise MespError("--rss-steps must be >= 1")
    quick = getattr(ns, "quick", False) or ns.bench == "quick"
    if quick and ns.threads is None:
        ns.threads = 1  # tiny ops: a second thread only adds sync overhead on a busy machine
    opts = BenchOptions(
        quick=quick, engines=ns.engines, shapes=ns.shapes, seqs=ns.seq, ranks=ns.rank,
        skip=tuple(ns.skip), dtype=ns.dtype, steps=ns.steps, rss_steps=ns.rss_steps,
        warmup=ns.warmup, timeout=ns.timeout, threads=ns.threads, matmul=ns.matmul,
        device=ns.device, out=ns.out, command=canonical(ns),
    )  # fmt: skip
    table = "table1" if ns.bench == "quick" else ns.bench
    return measure_then_report(ns, lambda: run_table(table, opts), summary, mkdir=True)


def run_ladder(ns: argparse.Namespace) -> int:
    from mesp.bench.ladder import LadderOptions, line, run_ladder

    if not 0.0 < ns.fraction <= 1.0:
        raise MespError(f"--fraction must be in (0, 1], got {ns.fraction}")
    ns.dtype, ns.device = ns.dtype or "float32", ns.device or "meta"
    opts = LadderOptions(device=ns.device, dtype=ns.dtype, fraction=ns.fraction, out=ns.out)
    ns.shapes, ns.seq = (ns.shapes or (opts.shape,))[:1], ns.seq or opts.seqs
    opts.shape, opts.seqs = ns.shapes[0], ns.seq
    opts.rungs, opts.timeout, opts.threads = ns.rungs, ns.timeout, ns.threads
    opts.command = canonical(ns)
    return measure_then_report(ns, lambda: run_ladder(opts), line, mkdir=True)


def run_softmax(ns: argparse.Namespace) -> int:
    from mesp.bench.softmax import SoftmaxConfig, line, run_softmax

    if ns.train_steps < 1 or ns.vocab_subset < 1:
        raise MespError("--train-steps and --vocab-subset must be positive")
    ns.seq, ns.models = (ns.seq or (128,))[:1], ns.models or ("smollm2", "gemma3-270m")
    base = SoftmaxConfig(
        model="", loss="ce", steps=ns.train_steps, seq=ns.seq[0], vocab_subset=ns.vocab_subset
    )
    cmd = canonical(ns)
    return measure_then_report(
        ns, lambda: run_softmax(ns.models, base, ns.out, ns.timeout, cmd), line
    )


def run_dequant(ns: argparse.Namespace) -> int:
    from mesp.bench.dequant import line, run_dequant

    check_steps(ns)
    cmd = canonical(ns)
    return measure_then_report(
        ns, lambda: run_dequant(ns.out, ns.steps, ns.warmup, ns.threads, cmd), line
    )


def run_dpo(ns: argparse.Namespace) -> int:
    """A DPO step beside SFT on the same tokens (mesp/bench/dpo.py); mesp-sft, mesp-dpo always."""
    from mesp.bench import dpo

    return _side_by_side(ns, "dpo", dpo.VARIANTS, dpo.line, dpo.run_dpo)


def run_dp(ns: argparse.Namespace) -> int:
    """A DP-SGD step beside SFT on --batch rows (mesp/bench/dp.py); mesp-sft always."""
    from mesp.bench import dp

    return _side_by_side(ns, "dp", dp.VARIANTS, dp.line, partial(dp.run_dp, batch=ns.batch))


def _side_by_side(ns: argparse.Namespace, what: str, all_variants, line, run) -> int:  # type: ignore[no-untyped-def]
    """The variants of one --shapes / --seq / --rank built and timed in this process, --steps
    rounds after --warmup steps each (dpo, dp); --engines picks among them."""
    from mesp.bench.targets import cpu_dtype

    ns.dtype = ns.dtype or cpu_dtype()
    variants = tuple(ns.engines) if ns.engines else all_variants
    shape, seq, rank = one_config(ns, what, "qwen2.5-0.5b", 256, 8)
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    cmd = canonical(ns)
    return measure_then_report(
        ns,
        lambda: run(ns.out, shape, seq, rank, ns.dtype, ns.steps, ns.warmup, cmd, variants),
        line,
    )


def run_speed(ns: argparse.Namespace) -> int:
    """Variants' step times side by side in one process (mesp/bench/speed.py): --engines
    (the first is the reference of the ratios; `name:dtype` for a dtype of its own), one
    --shapes / --seq / --rank configuration, --steps rounds after --warmup steps each."""
    from mesp.bench.speed import line, run_speed
    from mesp.bench.targets import cpu_dtype

    ns.dtype = ns.dtype or cpu_dtype()
    ns.engines = ns.engines or ("mesp", "peft-gc", "mesp-fp", "mebp")
    shape, seq, rank = one_config(ns, "speed", "qwen2.5-0.5b", 256, 8)
    cmd = canonical(ns)
    return measure_then_report(
        ns,
        lambda: run_speed(
            ns.out, shape, seq, rank, ns.dtype, ns.engines, ns.steps, ns.warmup, cmd, ns.matmul
        ),
        line,
    )


def run_profile(ns: argparse.Namespace) -> int:
    """Where a step's time goes (mesp/bench/profile.py): each --engines entry (mesp, mebp, bp;
    a -fp suffix: the fp32/bf16 base instead of 4-bit g64) on each --shapes, one profiled step
    after --warmup and --steps plain ones."""
    from mesp.bench.profile import line, run_profile
    from mesp.bench.targets import cpu_dtype

    check_steps(ns)
    ns.dtype = ns.dtype or cpu_dtype()
    ns.engines, ns.shapes = ns.engines or ("mesp", "mesp-fp"), ns.shapes or ("qwen2.5-0.5b",)
    engines = []
    for v in ns.engines:
        e = v.removesuffix("-fp")
        if e not in ("mesp", "mebp", "bp"):
            raise MespError(f"profile: --engines takes mesp, mebp, bp (optionally -fp), got {v!r}")
        engines.append((e, None if v.endswith("-fp") else 4))
    cmd = canonical(ns)

    def measure() -> list:
        from mesp.bench.variants import shape_dict

        rows = []
        for shape in ns.shapes:
            shape_dict(shape)  # an unknown shape: one line, before anything runs
            for e, bits in engines:
                rows += run_profile(ns.out, e, shape, ns.dtype, bits, ns.steps, ns.warmup, cmd)
        return rows

    return measure_then_report(ns, measure, line)


def run_decode(ns: argparse.Namespace) -> int:
    """The int4 decode kernel against dequantize + matmul (mesp/bench/decode.py): per layer,
    and `mesp generate` on each --models entry (default smollm2) for --decode-tokens tokens."""
    from mesp.bench.decode import line, run_decode

    check_steps(ns)
    if ns.decode_tokens < 1:
        raise MespError("--decode-tokens must be >= 1")
    ns.models = ns.models or ("smollm2",)
    cmd = canonical(ns)
    return measure_then_report(
        ns, lambda: run_decode(ns.out, ns.models, ns.decode_tokens, ns.steps, ns.warmup, cmd), line
    )


def run_ondevice(ns: argparse.Namespace) -> int:
    """The native runner against the in-process engine (mesp/bench/ondevice.py): a row per
    --shapes / --models entry, --seq and --rank (and --dp clipping), --steps + 1 steps."""
    from mesp.bench.ondevice import OndeviceConfig, line, run_ondevice

    if ns.steps < 1:
        raise MespError("--steps must be >= 1")
    if ns.memory_cap is not None and ns.memory_cap <= 0:
        raise MespError(f"--memory-cap must be a positive number of MB, got {ns.memory_cap:g}")
    if ns.weight_block_kb < 0:
        raise MespError("--weight-block-kb must be 0 (whole matrices) or positive")
    capped = ns.memory_cap is not None or ns.find_cap
    if capped and (ns.dp or ns.checkpoint_dtype):
        raise MespError("--dp and --checkpoint-dtype run without a memory cap")
    models = tuple(ns.models or ())
    ns.shapes = ns.shapes or (() if models else ("qwen2.5-0.5b",))
    ns.seq, ns.rank = ns.seq or (256,), ns.rank or (8,)
    cmd = canonical(ns)

    def measure() -> list[dict[str, Any]]:
        from mesp.bench.ondevice_cap import run_caps

        rows = []
        what = [(s, None) for s in ns.shapes] + [("qwen2.5-0.5b", m) for m in models]
        for (shape, model), seq, rank in itertools.product(what, ns.seq, ns.rank):
            c = OndeviceConfig(
                shape=shape, model=model, seq=seq, rank=rank, steps=ns.steps + 1,
                weight_block_kb=ns.weight_block_kb, checkpoints_on_disk=ns.checkpoints_on_disk,
            )  # fmt: skip
            if capped:
                rows += run_caps(ns.out, c, cmd, ns.memory_cap, ns.find_cap, ns.timeout)
            else:
                rows += run_ondevice(ns.out, c, cmd, ns.timeout, ns.dp, ns.checkpoint_dtype)
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

    check_steps(ns)
    ns.dtype, ns.device = ns.dtype or "float32", ns.device or "cpu"
    ns.shapes = (ns.shapes or ("tiny-qwen2" if ns.quick else "qwen2.5-0.5b",))[:1]
    ns.seq = ns.seq or ((32, 64) if ns.quick else (256, 1024))
    ns.rank = (ns.rank or (8,))[:1]
    if ns.quick and ns.threads is None:
        ns.threads = 1
    cmd = canonical(ns)
    return measure_then_report(
        ns,
        lambda: dropin_bench.run(
            tuple(ns.seq),
            ns.shapes[0],
            ns.dtype,
            ns.steps,
            ns.threads,
            timeout=ns.timeout,
            rank=ns.rank[0],
            warmup=ns.warmup,
            out=ns.out,
            command=cmd,
            skip=tuple(ns.skip),
            device=ns.device,
        ),  # fmt: skip
        dropin_bench.line,
    )
