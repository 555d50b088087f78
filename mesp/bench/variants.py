"""The variants a benchmark builds: one configuration (`ChildConfig`), its model shape and
random batch, and the step of mesp's model + an engine or of the HF + PEFT + checkpointing
baseline. The child process (child.py), the side-by-side rounds (speed.py) and the profiler
(profile.py) all build their steps here, so every table times the same thing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mesp.batch import Batch, keep_last_fraction
from mesp.errors import MespError
from mesp.models.transformer import LORA_TARGETS

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
    # a real model (a path or a named one, e.g. qwen2.5-coder-0.5b) instead of `shape`'s random
    # weights: its quantized codes as stored (bits / group_size unused), mesp engines only
    model: str | None = None


def shape_dict(name: str) -> dict[str, Any]:
    from mesp.loading.zoo import SHAPES

    if name == "tiny-qwen2":
        return dict(TINY_SHAPE)
    key = name.removeprefix("random:")
    if key not in SHAPES:
        raise MespError(f"unknown shape {name!r}; known: tiny-qwen2, {', '.join(SHAPES)}")
    return dict(SHAPES[key])


Step = Callable[[], float]


def mesp_setup(c: ChildConfig, dtype: torch.dtype, batch: Batch) -> tuple[Step, list, list, Any]:
    """Our model: random weights of the named shape, LoRA on the 7 projections, an engine."""
    from mesp.config import ModelConfig
    from mesp.engines import make_engine
    from mesp.loading import random_model
    from mesp.lora import LoraConfig, apply_lora
    from mesp.quant import QuantSpec
    from mesp.training.schedule import make_optimizer

    if c.model:
        from mesp.loading.session import ModelOptions, open_model

        name = str(dtype).removeprefix("torch.")
        model = open_model(ModelOptions(model=c.model, dtype=name)).model
        cfg, quant = model.config, None
    else:
        cfg = ModelConfig.from_hf(shape_dict(c.shape), source=c.shape)
        quant = QuantSpec(c.bits, c.group_size) if c.bits else None
        model = random_model(cfg, quant, dtype, seed=c.seed, device=c.device)
    apply_lora(model, LoraConfig(rank=c.rank), seed=c.seed)
    model.to(c.device)  # the adapter too, on a meta model
    opts = _engine_opts(c)
    if c.max_memory:
        opts["keep_tapes"] = planned_tapes(c, cfg, quant, dtype)
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

    # a real model's codes mix types: no analytic floor for it (cfg None)
    return step, list(model.buffers()), params, (opt, None if c.model else cfg, quant)


def planned_tapes(c: ChildConfig, cfg: Any, quant: Any, dtype: torch.dtype) -> int:
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


def peft_setup(c: ChildConfig, dtype: torch.dtype, batch: Batch) -> tuple[Step, list, list, Any]:
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

    step.model = model  # type: ignore[attr-defined]  # mesp bench dpo runs its own loss on it
    return step, frozen, params, (opt, None, None)


def model_config(c: ChildConfig) -> Any:
    from mesp.config import ModelConfig

    if c.model:
        from mesp.loading.info import config_of
        from mesp.loading.session import ModelOptions

        return config_of(ModelOptions(model=c.model))
    return ModelConfig.from_hf(shape_dict(c.shape), source=c.shape)


def random_batch(c: ChildConfig) -> Batch:
    """The configuration's one random sequence per row (seed + 1), its last `loss_fraction`
    of positions trained: what every timed or profiled step of `c` trains on."""
    vocab = model_config(c).vocab_size if c.model else shape_dict(c.shape)["vocab_size"]
    g = torch.Generator().manual_seed(c.seed + 1)
    ids = torch.randint(0, vocab, (c.batch, c.seq + 1), generator=g)
    mask = torch.ones(c.batch, c.seq, dtype=torch.bool)
    return keep_last_fraction(Batch(ids[:, :-1], ids[:, 1:], mask), c.loss_fraction)
