"""One benchmark configuration, measured in a fresh process: `python -m mesp.bench.child JSON`.

A fresh process per configuration keeps one engine's allocator state, caches and RSS high-water
mark out of the next one's numbers (the parent runs it through `memory_rss.run_child`, which
sets the faithful-malloc environment). Three measurements of one optimizer step (engine step +
SGD step), each after warm-up: the exact live-tensor peak (with a per-op timeline and what was
live at the peak), the process RSS peak, and the median wall time of `steps` untracked steps.
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
from torch.utils._python_dispatch import TorchDispatchMode

from mesp.batch import Batch, keep_last_fraction
from mesp.errors import MespError
from mesp.memory.rss import current_rss_bytes, peak_rss_bytes, report, reset_peak_rss
from mesp.memory.tracker import LiveTensorTracker, adapter_tensors
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


class TimelineTracker(LiveTensorTracker):
    """The exact tracker plus a sample of live bytes after every op, and for each allocation
    the op, shape and the innermost non-torch source line that made it: what the peak is."""

    def __init__(self, timeline: bool) -> None:
        super().__init__()
        self.samples: list[int] | None = [] if timeline else None
        self._new: dict[int, Any] = {}  # uid -> entry, allocations of the op in flight
        self.origin: dict[int, str] = {}  # uid -> "site op shape dtype"

    def _track(self, st: torch.UntypedStorage) -> Any:
        known = self._live.get(st._cdata)
        entry = super()._track(st)
        if entry is not None and entry is not known:
            self._new[entry.uid] = entry
        return entry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        self._new.clear()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._new:
            site = _site()
            for leaf in torch.utils._pytree.tree_leaves(out):
                if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
                    continue
                entry = self._live.get(leaf.untyped_storage()._cdata)
                if entry is not None and entry.uid in self._new:
                    shape = "x".join(map(str, leaf.shape))
                    self.origin[entry.uid] = f"{site} {func.__name__} {shape} {leaf.dtype}"
        if self.samples is not None:
            self.samples.append(self.current_bytes)
        return out

    def peak_composition(self, top: int = 12) -> list[dict[str, Any]]:
        """Working tensors live at the peak, grouped by where they were made, largest first."""
        groups: dict[str, list[int]] = {}
        for uid, nbytes in self.live_at_peak().items():
            if uid in self._category:  # registered weights / adapter
                continue
            key = self.origin.get(uid, "(unknown)")
            acc = groups.setdefault(key, [0, 0])
            acc[0] += nbytes
            acc[1] += 1
        rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"what": k, "bytes": b, "count": n} for k, (b, n) in rows]

    def downsampled(self, points: int, base: int) -> list[int]:
        """At most `points` samples of (live − base) bytes; max per bucket keeps the peak."""
        s = [x - base for x in self.samples or []]
        if len(s) <= points:
            return s
        step = -(-len(s) // points)
        return [max(s[i : i + step]) for i in range(0, len(s), step)]


_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_INPLACE = {
    _aten.addmm_.default: _aten.addmm.default,
    _aten.baddbmm_.default: _aten.baddbmm.default,
}


class Fp32Matmul(TorchDispatchMode):
    """For the PEFT baseline only: its bf16/fp16 CPU matmuls computed in fp32 and rounded back,
    what mesp itself does in mesp/ops/matmul.py where the CPU has no bf16 GEMM (torch's fallback
    is 5-160x slower than fp32 there), so that both sides of a comparison time an fp32 GEMM.
    Sits below the tracker, so the exact peak sees bf16 in and out; RSS sees the fp32 copies."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _MATMULS or func in _INPLACE:
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            if all(t.dtype in (torch.bfloat16, torch.float16) and not t.is_cuda for t in ts):
                up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                if func in _MATMULS:
                    return func(*up, **kwargs).to(ts[0].dtype)
                return args[0].copy_(_INPLACE[func](*up, **kwargs))
        return func(*args, **kwargs)


def _site() -> str:
    """file:line(function) of the innermost frame outside torch and this module."""
    f = sys._getframe(2)
    here = os.path.abspath(__file__)
    while f is not None:
        path = f.f_code.co_filename
        if path != here and f"{os.sep}torch{os.sep}" not in path and "memory_tracker" not in path:
            return f"{os.path.basename(path)}:{f.f_lineno}({f.f_code.co_name})"
        f = f.f_back
    return "(unknown)"


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
    if c.threads:
        torch.set_num_threads(c.threads)
    dtype = getattr(torch, c.dtype)
    # mesp's engines pick their bf16 kernel themselves (mesp.ops.matmul), as in `mesp train`;
    # the switch is its environment variable, set here for this child process only.
    os.environ[matmul_ops.ENV] = c.matmul
    fp32_mm = matmul_ops.computes_in_fp32(torch.empty(0, dtype=dtype, device=c.device))
    baseline = c.engine == "peft" and fp32_mm
    with Fp32Matmul() if baseline else contextlib.nullcontext():
        res = _measure(c, dtype)
    if not fp32_mm:
        res["matmul"] = "native"
    elif baseline:
        res["matmul"] = "fp32-accumulate substitute (PEFT baseline)"
    else:
        res["matmul"] = "fp32 compute, bf16 storage (mesp.ops.matmul, the product's path)"
    return res


def _measure(c: ChildConfig, dtype: torch.dtype) -> dict[str, Any]:
    vocab = shape_dict(c.shape)["vocab_size"]
    g = torch.Generator().manual_seed(c.seed + 1)
    ids = torch.randint(0, vocab, (c.batch, c.seq + 1), generator=g)
    mask = torch.ones(c.batch, c.seq, dtype=torch.bool)
    batch = keep_last_fraction(Batch(ids[:, :-1], ids[:, 1:], mask), c.loss_fraction)
    if c.device == "meta":  # inputs as meta tensors; targets and mask stay on the host
        batch = Batch(batch.input_ids.to("meta"), batch.targets, batch.mask)
    t0 = time.perf_counter()
    setup = _peft_setup if c.engine == "peft" else _mesp_setup
    step, weights, params, (opt, cfg, quant) = setup(c, dtype, batch)
    build_s = time.perf_counter() - t0
    losses = [step() for _ in range(c.warmup)]

    # 1. Exact live-tensor peak of one step, split weights / adapter / working.
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

    # 2. RSS and 3. time: untracked steps, VmHWM reset right before each.
    times, rss_step, rss_peak, rss_before, hwm_ok = [], 0, 0, 0, True
    for _ in range(0 if c.device == "meta" else max(1, c.steps)):
        gc.collect()
        hwm_ok = reset_peak_rss() and hwm_ok
        before = current_rss_bytes()
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
        peak = peak_rss_bytes()
        if peak - before > rss_step:
            rss_step, rss_before = peak - before, before
        rss_peak = max(rss_peak, peak)

    floor, floor_note = _floor(c, cfg, quant, dtype)
    median = statistics.median(times) if times else None
    timing = {"median_s": median, "steps_s": times}
    if median:
        timing["tokens_per_s"] = c.batch * c.seq / median
    return {
        "config": asdict(c),
        "exact": split,
        "peak_composition": composition,
        "timeline": timeline,
        "time": timing if times else None,
        "rss": None
        if c.device == "meta"
        else {
            "step_bytes": rss_step,
            "peak_bytes": rss_peak,
            "before_bytes": rss_before,
            "hwm_reset": hwm_ok,
        },
        "build_s": build_s,
        "tracked_s": tracked_s,
        "floor": floor,
        "floor_note": floor_note,
        "kept_tapes": _kept_tapes(c, cfg, quant, dtype) if c.max_memory else None,
        "losses": losses,
        "adapter_params": sum(p.numel() for p in params),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_after": os.getloadavg()[0],
    }


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
