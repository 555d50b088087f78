"""One benchmark configuration, measured in a fresh process: `python -m mesp.bench.child JSON`.

A fresh process per configuration keeps one engine's allocator state, caches and RSS high-water
mark out of the next one's numbers. Each configuration runs as two children (`part`), because
the malloc setting that makes RSS faithful makes time unfaithful:

- "memory", run with FAITHFUL_MALLOC_ENV (`memory.rss.run_child`: every free handed back to
  the kernel, so RSS tracks live memory): after warm-up, the exact live-tensor peak of one step
  (engine step + SGD step, with a per-op timeline and what was live at the peak), then the RSS
  rise of `rss_steps` untracked steps.
- "time", run without it (MALLOC_MMAP_THRESHOLD_ turns every temporary into fresh page
  faults): after warm-up, `steps` untracked steps, each right after a GEMM rate probe at the
  model's projection shapes (mesp.bench.floor); their median wall time, and the matmul floor
  6·N·T at the probed rates beside it (each step against its own probe).

Each child reports the malloc variables it ran under (`malloc_env`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, is_dataclass
from typing import Any

import torch

from mesp.batch import Batch
from mesp.bench.tracking import Fp32Matmul, TimelineTracker
from mesp.bench.variants import (
    ChildConfig,
    Step,
    mesp_setup,
    model_config,
    peft_setup,
    planned_tapes,
    random_batch,
)
from mesp.errors import MespError
from mesp.memory.rss import (
    FAITHFUL_MALLOC_ENV,
    current_rss_bytes,
    peak_rss_bytes,
    report,
    reset_peak_rss,
)
from mesp.memory.tracker import adapter_tensors
from mesp.models.transformer import LORA_TARGETS
from mesp.ops import matmul as matmul_ops


def _floor(c: ChildConfig, cfg: Any, quant: Any, dtype: torch.dtype) -> tuple[Any, str | None]:
    """The analytic memory floor, when mesp.memory.model exists in this build."""
    if cfg is None:
        return None, "no floor for the PEFT model or a real model's mixed stored codes"
    try:
        from mesp.memory.model import analytic_floor
    except ImportError:
        return None, "mesp.memory.model not available"
    try:
        f = analytic_floor(cfg, c.seq, c.batch, c.rank, LORA_TARGETS, quant, dtype)
    except Exception as e:  # a model still being written must not sink the measurement
        return None, f"analytic_floor failed: {type(e).__name__}: {e}"
    if is_dataclass(f) and not isinstance(f, type):
        f = asdict(f)
    if isinstance(f, (int, float)):  # bytes beyond the frozen weights: adapter + working
        f = {"adapter_working": f}
    if isinstance(f, dict):  # keep the numbers only: JSON-safe
        return {k: v for k, v in f.items() if isinstance(v, (int, float))}, None
    return None, f"analytic_floor returned {type(f).__name__}"


def measure(c: ChildConfig) -> dict[str, Any]:
    if c.part not in PARTS:
        raise MespError(f"part must be one of {', '.join(PARTS)}, got {c.part!r}")
    if c.part == "time" and c.device == "meta":
        raise MespError("the meta device has no time")
    if c.threads:
        torch.set_num_threads(c.threads)
    dtype = getattr(torch, c.dtype)
    # mesp's engines pick their bf16 kernel themselves (mesp.ops.matmul), as in `mesp train`;
    # the switch is its environment variable, set here for this child process only.
    os.environ[matmul_ops.ENV] = c.matmul
    fp32_mm = matmul_ops.computes_in_fp32(torch.empty(0, dtype=dtype, device=c.device))
    baseline = c.engine == "peft" and fp32_mm
    # the GEMM probe's operands, made before the model exists; it runs before every timed step
    gemm = _gemm_probe(c, dtype) if c.part == "time" else None
    with Fp32Matmul() if baseline else contextlib.nullcontext():
        res = _measure(c, dtype, gemm)
    if not fp32_mm:
        res["matmul"] = "native"
    elif baseline:
        res["matmul"] = "fp32-accumulate substitute (PEFT baseline)"
    else:
        res["matmul"] = "fp32 compute, bf16 storage (mesp.ops.matmul, the product's path)"
    res["bf16_gemm"] = matmul_ops.native_kernel(torch.bfloat16)
    res["malloc_env"] = {k: os.environ[k] for k in FAITHFUL_MALLOC_ENV if k in os.environ}
    return res


PARTS = ("memory", "time")


def _gemm_probe(c: ChildConfig, dtype: torch.dtype) -> Any:
    from mesp.bench.floor import GemmProbe

    return GemmProbe(model_config(c), c.batch * c.seq, dtype)


def _measure(c: ChildConfig, dtype: torch.dtype, gemm: Any) -> dict[str, Any]:
    batch = random_batch(c)
    if c.device == "meta":  # inputs as meta tensors; targets and mask stay on the host
        batch = Batch(batch.input_ids.to("meta"), batch.targets, batch.mask)
    t0 = time.perf_counter()
    setup = peft_setup if c.engine == "peft" else mesp_setup
    step, weights, params, (opt, cfg, quant) = setup(c, dtype, batch)
    build_s = time.perf_counter() - t0
    losses = [step() for _ in range(c.warmup)]
    common = {
        "config": asdict(c),
        "build_s": build_s,
        "kept_tapes": planned_tapes(c, cfg, quant, dtype) if c.max_memory else None,
        "adapter_params": sum(p.numel() for p in params),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if c.part == "time":
        res = _time_part(c, step, losses, gemm)
    else:
        res = _memory_part(c, step, losses, weights, params, opt)
        floor, floor_note = _floor(c, cfg, quant, dtype)
        res.update(floor=floor, floor_note=floor_note)
    return {**common, **res, "losses": losses, "load_after": os.getloadavg()[0]}


def _memory_part(
    c: ChildConfig, step: Step, losses: list[float], weights: list, params: list, opt: Any
) -> dict[str, Any]:
    """1. Exact live-tensor peak of one step, split weights / adapter / working; 2. the RSS
    rise of untracked steps, VmHWM reset right before each."""
    gc.collect()
    opt.zero_grad(set_to_none=True)
    tracker = TimelineTracker(timeline=c.timeline)
    tracker.register(weights, "weights")
    tracker.register(adapter_tensors(params, opt), "adapter")
    base = tracker.current_bytes
    t = time.perf_counter()
    with tracker:
        losses.append(step())
    tracked_s = time.perf_counter() - t
    split = tracker.breakdown(weights=weights, adapter=adapter_tensors(params, opt))
    composition = tracker.peak_composition()
    timeline = tracker.downsampled(2000, base) if c.timeline else None
    del tracker

    rss_step, rss_peak, rss_before, hwm_ok = 0, 0, 0, True
    for _ in range(0 if c.device == "meta" else max(1, c.rss_steps)):
        gc.collect()
        hwm_ok = reset_peak_rss() and hwm_ok
        before = current_rss_bytes()
        losses.append(step())
        peak = peak_rss_bytes()
        if peak - before > rss_step:
            rss_step, rss_before = peak - before, before
        rss_peak = max(rss_peak, peak)
    rss = {"step_bytes": rss_step, "peak_bytes": rss_peak, "before_bytes": rss_before,
           "hwm_reset": hwm_ok}  # fmt: skip
    return {
        "exact": split,
        "peak_composition": composition,
        "timeline": timeline,
        "rss": None if c.device == "meta" else rss,
        "tracked_s": tracked_s,
    }


def _time_part(c: ChildConfig, step: Step, losses: list[float], probe: Any) -> dict[str, Any]:
    """3. The median wall time of `steps` untracked steps, each right after a GEMM-rate probe
    (best of 3 passes), and the matmul floor beside it. The rate of this shared machine drifts
    by tens of percent from one step to the next, so each step is set against the floor at
    the rate probed just before it, and the row's floor ratio is the median of those pairs;
    its floor in seconds is the one at the median probed rate."""
    from mesp.bench.floor import matmul_floor

    cfg, tokens = model_config(c), c.batch * c.seq
    times, probes, ratios = [], [], []
    for _ in range(max(1, c.steps)):
        gc.collect()
        g = probe.rate(passes=3)
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
        probes.append(g)
        ratios.append(times[-1] / matmul_floor(cfg, tokens, g["gflops"])["seconds"])
    median = statistics.median(times)
    timing = {"median_s": median, "steps_s": times, "tokens_per_s": tokens / median}
    timing["floor_ratio"] = statistics.median(ratios)
    timing["floor_ratios"] = ratios
    rates = [g["gflops"] for g in probes]
    gemm = {**probes[0], "gflops": statistics.median(rates), "per_step_gflops": rates}
    gemm.pop("passes_s")
    floor = matmul_floor(cfg, tokens, gemm["gflops"])
    return {"time": timing, "gemm": gemm, "matmul_floor": floor}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mesp.bench.child '<json config>'", file=sys.stderr)
        return 2
    c = ChildConfig(**json.loads(argv[0]))
    try:
        report(status="ok", **measure(c))
    except MespError as e:  # e.g. mezo not in this build: a skip, not a crash
        report(status="skipped", reason=str(e), config=asdict(c))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
