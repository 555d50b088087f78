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
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import torch

from mesp.batch import Batch, keep_last_fraction
from mesp.bench.tracking import Fp32Matmul, TimelineTracker
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

# A 2-layer Qwen2 for `--quick`: every code path of the real shapes at a few MB.
TINY_SHAPE = dict(
    model_type="qwen2",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


@dataclass
class ChildConfig:
    """What one child measures. `engine` is bp | mebp | mesp | mezo | peft (HF + PEFT + gc)."""

    variant: str
    engine: str
    shape: str = "qwen2.5-0.5b"
    seq: int = 256
    batch: int = 1
    rank: int = 8
    bits: int | None = 4  # None: unquantized base
    group_size: int = 64
    dtype: str = "bfloat16"
    h_strategy: str = "recompute"
    warmup: int = 1
    steps: int = 3
    timeline: bool = False
    seed: int = 0
    threads: int | None = None  # torch threads; None: torch's default (all cores)
    matmul: str = "auto"  # auto | native | fp32: mesp.ops.matmul's MESP_BF16_MATMUL
    # "meta": the exact tracker on the meta device (bytes without arithmetic; no RSS, no time)
    device: str = "cpu"
    loss: str = "ce"  # ce | sampled-softmax
    vocab_subset: int = 1000
    mask_logits: bool = True
    chunk_rows: int | None = 512  # mesp's CE: None = every row at once
    vocab_chunk: int | None = 8192  # mesp's CE: None = the head in one piece
    offload: str = "none"
    stream_weights: bool = False  # mesp: block weights on disk, streamed
    loss_fraction: float = 1.0  # trained share of positions (the last ones of the row)
    # mesp: a --max-memory budget; the planner picks how many tapes to keep under it
    max_memory: str | None = None
    part: str = "memory"  # memory (exact peak + RSS) | time (GEMM probe + timed steps)
    rss_steps: int = 1  # memory part: untracked steps whose RSS rise is measured (max taken)


def shape_dict(name: str) -> dict[str, Any]:
    from mesp.loading.zoo import SHAPES

    if name == "tiny-qwen2":
        return dict(TINY_SHAPE)
    key = name.removeprefix("random:")
    if key not in SHAPES:
        raise MespError(f"unknown shape {name!r}; known: tiny-qwen2, {', '.join(SHAPES)}")
    return dict(SHAPES[key])


Step = Callable[[], float]


def _mesp_setup(c: ChildConfig, dtype: torch.dtype, batch: Batch) -> tuple[Step, list, list, Any]:
    """Our model: random weights of the named shape, LoRA on the 7 projections, an engine."""
    from mesp.config import ModelConfig
    from mesp.engines import make_engine
    from mesp.loading import random_model
    from mesp.lora import LoraConfig, apply_lora
    from mesp.quant import QuantSpec
    from mesp.training.schedule import make_optimizer

    cfg = ModelConfig.from_hf(shape_dict(c.shape), source=c.shape)
    quant = QuantSpec(c.bits, c.group_size) if c.bits else None
    model = random_model(cfg, quant, dtype, seed=c.seed, device=c.device)
    apply_lora(model, LoraConfig(rank=c.rank), seed=c.seed)
    model.to(c.device)  # the adapter too, on a meta model
    opts = _engine_opts(c)
    if c.max_memory:
        opts["keep_tapes"] = _kept_tapes(c, cfg, quant, dtype)
    engine = make_engine(c.engine, **opts)
    if c.stream_weights:  # before the weights are listed: streamed blocks leave memory now
        engine.attach(model)  # type: ignore[attr-defined]
    params = model.lora_parameters()
    opt = make_optimizer(params, "sgd", 1e-4, 0.0)
    n = batch.n_tokens

    def step() -> float:
        opt.zero_grad(set_to_none=True)  # grads made inside the step count as adapter memory
        loss = engine.step(model, batch, n)
        opt.step()
        return loss

    return step, list(model.buffers()), params, (opt, cfg, quant)


def _kept_tapes(c: ChildConfig, cfg: Any, quant: Any, dtype: torch.dtype) -> int:
    """What `mesp train --max-memory` would keep under c.max_memory (this step's SGD)."""
    from mesp.memory.plan import Run, kept_tapes, parse_bytes

    run = Run(c.seq, c.batch, c.rank, LORA_TARGETS, quant, dtype, "sgd")
    return kept_tapes(parse_bytes(c.max_memory or "0"), cfg, run)


def _engine_opts(c: ChildConfig) -> dict[str, Any]:
    from mesp.engines.loss import LossSpec

    opts: dict[str, Any] = {"loss": LossSpec(c.loss, c.vocab_subset, c.mask_logits, c.seed)}
    if c.engine in ("mesp", "mebp"):
        opts["offload"] = c.offload
    if c.engine == "mesp":
        opts.update(h_strategy=c.h_strategy, chunk_rows=c.chunk_rows, vocab_chunk=c.vocab_chunk)
        opts["stream_weights"] = c.stream_weights
    return opts


def _peft_setup(c: ChildConfig, dtype: torch.dtype, batch: Batch) -> tuple[Step, list, list, Any]:
    """What users would pick instead: transformers Qwen2 + PEFT LoRA + gradient checkpointing."""
    import transformers as tf
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from mesp.engines.loss import ce_sum
    from mesp.training.schedule import make_optimizer

    d = shape_dict(c.shape)
    if d.pop("model_type") != "qwen2":
        raise MespError("the PEFT baseline is built for qwen2 shapes only")
    torch.manual_seed(c.seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(**d), dtype=dtype)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = PeftLoraConfig(
        r=c.rank, lora_alpha=2 * c.rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    model = get_peft_model(hf, lcfg)
    model.train()  # HF checkpoints only in training mode
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    opt = make_optimizer(params, "sgd", 1e-4, 0.0)
    n = batch.n_tokens

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=batch.input_ids, use_cache=False).logits
        loss = ce_sum(logits, batch.targets, batch.mask)
        del logits
        (loss / n).backward()
        opt.step()
        return float(loss.item())

    return step, frozen, params, (opt, None, None)


def _floor(c: ChildConfig, cfg: Any, quant: Any, dtype: torch.dtype) -> tuple[Any, str | None]:
    """The analytic memory floor, when mesp.memory.model exists in this build."""
    if cfg is None:
        return None, "no floor for the PEFT model"
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


def _model_config(c: ChildConfig) -> Any:
    from mesp.config import ModelConfig

    return ModelConfig.from_hf(shape_dict(c.shape), source=c.shape)


def _gemm_probe(c: ChildConfig, dtype: torch.dtype) -> Any:
    from mesp.bench.floor import GemmProbe

    return GemmProbe(_model_config(c), c.batch * c.seq, dtype)


def random_batch(c: ChildConfig) -> Batch:
    """The configuration's one random sequence per row (seed + 1), its last `loss_fraction`
    of positions trained: what every timed or profiled step of `c` trains on."""
    vocab = shape_dict(c.shape)["vocab_size"]
    g = torch.Generator().manual_seed(c.seed + 1)
    ids = torch.randint(0, vocab, (c.batch, c.seq + 1), generator=g)
    mask = torch.ones(c.batch, c.seq, dtype=torch.bool)
    return keep_last_fraction(Batch(ids[:, :-1], ids[:, 1:], mask), c.loss_fraction)


def _measure(c: ChildConfig, dtype: torch.dtype, gemm: Any) -> dict[str, Any]:
    batch = random_batch(c)
    if c.device == "meta":  # inputs as meta tensors; targets and mask stay on the host
        batch = Batch(batch.input_ids.to("meta"), batch.targets, batch.mask)
    t0 = time.perf_counter()
    setup = _peft_setup if c.engine == "peft" else _mesp_setup
    step, weights, params, (opt, cfg, quant) = setup(c, dtype, batch)
    build_s = time.perf_counter() - t0
    losses = [step() for _ in range(c.warmup)]
    common = {
        "config": asdict(c),
        "build_s": build_s,
        "kept_tapes": _kept_tapes(c, cfg, quant, dtype) if c.max_memory else None,
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

    cfg, tokens = _model_config(c), c.batch * c.seq
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
