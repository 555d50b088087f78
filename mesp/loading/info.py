"""`mesp info`: architecture, dimensions, parameter counts and weight bytes, from the config."""

from __future__ import annotations

from pathlib import Path

import torch

from mesp.config import FULL, ModelConfig
from mesp.loading.build import expected_tensors
from mesp.loading.session import ModelOptions, open_model
from mesp.lora import lora_param_count
from mesp.models import FAMILIES
from mesp.models.linear import FrozenWeight
from mesp.models.transformer import LORA_TARGETS, CausalLM, is_target
from mesp.ops.rope import rot_dim
from mesp.quant import QuantSpec, quantized_bytes


def config_of(opts: ModelOptions) -> ModelConfig:
    """The config alone (no weights read): config.json, or a GGUF file's header."""
    from pathlib import Path

    from mesp.loading.zoo import random_shape, resolve

    if opts.model.startswith("random:"):
        return random_shape(opts.model)
    path = Path(resolve(opts.model) or opts.model)
    if path.is_dir():
        return ModelConfig.from_file(path / "config.json")
    if path.is_file() and path.suffix == ".gguf":
        from mesp.loading.gguf import GGUFFile

        with GGUFFile(path) as g:
            return ModelConfig.from_hf(g.config, source=str(path))
    return open_model(ModelOptions(model=str(path), quantize="none")).model.config


def stored_quant(opts: ModelOptions) -> QuantSpec | None:
    """The quantization an MLX directory is stored in (config.json "quantization"), if any."""
    import json
    from pathlib import Path

    from mesp.loading.zoo import resolve

    if opts.model.startswith("random:"):
        return None
    f = Path(resolve(opts.model) or opts.model) / "config.json"
    if not f.is_file():
        return None
    from mesp.loading.safetensors_dir import quant_spec

    q = json.loads(f.read_text()).get("quantization")
    return quant_spec(q, f) if isinstance(q, dict) and "bits" in q else None


def weight_bytes(cfg: ModelConfig, quant: QuantSpec | None, dtype: torch.dtype) -> dict[str, int]:
    """Parameter count and frozen-weight bytes, dense and with `quant` (norms stay dense)."""
    with torch.device("meta"):
        model = CausalLM(cfg, dtype)
    item = torch.tensor([], dtype=dtype).element_size()
    params = dense = packed = 0
    for mod in model.modules():
        if isinstance(mod, FrozenWeight):
            n = mod.out_features * mod.in_features
            params += n
            dense += n * item
            ok = quant is not None and mod.in_features % quant.group_size == 0
            packed += (
                quantized_bytes(mod.out_features, mod.in_features, quant, dtype) if ok else n * item
            )
    other = sum(b.numel() for n, b in model.named_buffers() if n.endswith(("norm.weight", ".bias")))
    params += other
    return {
        "params": params,
        "dense_bytes": dense + other * item,
        "quant_bytes": packed + other * item,
    }


def model_info(opts: ModelOptions, rank: int = 8, targets: tuple[str, ...] = LORA_TARGETS) -> str:
    cfg = config_of(opts)
    stored = stored_quant(opts)
    q = stored or opts.quant or QuantSpec()  # --quantize none: show what 4-bit would take
    wb = weight_bytes(cfg, q, opts.torch_dtype)
    with torch.device("meta"):
        lora_n = lora_param_count(CausalLM(cfg, opts.torch_dtype), rank, targets)
    mb = 2**20
    gl = gguf_lines(opts, cfg)
    how = "as stored" if stored else "with --quantize" if opts.quant else "if quantized"
    if gl:
        how = "with --quantize 4, requantized" if opts.keep_stored else how
    lines = [
        f"model        {opts.model}",
        f"family       {cfg.family}",
        f"layers       {cfg.num_hidden_layers}   hidden {cfg.hidden_size}   "
        f"intermediate {cfg.intermediate_size}",
        f"attention    {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} kv heads, "
        f"head_dim {cfg.head_dim}",
        f"vocab        {cfg.vocab_size}   tied embeddings: {cfg.tie_word_embeddings}",
        f"max context  {cfg.max_position_embeddings}",
    ]
    if cfg.sliding_window:
        n_sl = sum(t == "sliding_attention" for t in cfg.layer_types)
        lines.append(
            f"sliding      window {cfg.sliding_window} on {n_sl} of {cfg.num_hidden_layers} layers"
        )
    if FAMILIES[cfg.family].fused_proj:  # Phi-3
        lines.append("fused        qkv_proj (q | k | v), gate_up_proj (gate | up)")
    r = cfg.rope[FULL]
    if r.partial_rotary_factor != 1.0:  # Phi-4-mini
        lines.append(f"rotary       {rot_dim(r, cfg.head_dim)} of {cfg.head_dim} dims per head")
    if r.kind == "longrope":
        lines.append(
            f"rope         longrope: long factors past {r.original_max_position_embeddings} "
            f"tokens, cos/sin × {r.attention_factor:.4g}"
        )
    if not all(cfg.rope_layers):  # SmolLM3's NoPE layers; Granite's four scalars
        n_nope = cfg.rope_layers.count(False)
        lines.append(f"no RoPE      on {n_nope} of {cfg.num_hidden_layers} layers")
    if cfg.attn_logit_softcapping:  # Gemma 2
        lines.append(
            f"soft-caps    attention {cfg.attn_logit_softcapping:g}, "
            f"logits {cfg.final_logit_softcapping or 0:g} (0: none)"
        )
    if FAMILIES[cfg.family].post_norms:  # OLMo 2
        lines.append("norms        after attention and MLP outputs; q/k over whole projections")
    if cfg.residual_multiplier is not None:
        lines.append(
            f"multipliers  embedding {cfg.embedding_multiplier:g}, residual "
            f"{cfg.residual_multiplier:g}, attention {cfg.attention_multiplier:g}, "
            f"logits ÷ {cfg.logits_scaling:g}"
        )
    adapted = targets  # Phi-3: the fused linears the targets stand for
    if FAMILIES[cfg.family].fused_proj:
        fused = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        adapted = tuple(n for n in fused if is_target(n, tuple(targets)))
    lines += [
        f"parameters   {wb['params']:,}",
        f"weights      {wb['dense_bytes'] / mb:,.1f} MB in {opts.dtype}, "
        f"{wb['quant_bytes'] / mb:,.1f} MB at {q.bits}-bit group {q.group_size} ({how})",
        f"LoRA         {lora_n:,} parameters at rank {rank} on {','.join(adapted)} "
        f"({lora_n * 4 / mb:.2f} MB fp32)",
    ]
    return "\n".join(lines + gl)


def _stored_gguf(opts: ModelOptions) -> Path | None:
    """The GGUF file `opts` loads with its codes kept as stored, if it does."""
    from mesp.loading.zoo import resolve

    path = Path(resolve(opts.model) or opts.model)
    if opts.model.startswith("random:") or path.suffix != ".gguf" or not path.is_file():
        return None
    return path


def stored_weight_bytes(opts: ModelOptions, cfg: ModelConfig) -> int | None:
    """Bytes of every frozen tensor of a quantized GGUF loaded as stored (None: anything else,
    whose bytes follow from --quantize)."""
    path = _stored_gguf(opts) if opts.keep_stored else None
    if path is None:
        return None
    from mesp.loading.gguf import GGUFFile
    from mesp.loading.gguf_stored import memory_bytes

    with torch.device("meta"):
        shapes = expected_tensors(CausalLM(cfg, opts.torch_dtype))
    with GGUFFile(path) as g:
        return memory_bytes(g, shapes, opts.torch_dtype) if g.quantized else None


def gguf_lines(opts: ModelOptions, cfg: ModelConfig) -> list[str]:
    """A quantized GGUF's types, what each becomes and its bits per weight (none otherwise)."""
    path = _stored_gguf(opts)
    if path is None:
        return []
    from mesp.loading.gguf import GGUFFile
    from mesp.loading.gguf_stored import info_lines

    with torch.device("meta"):
        shapes = expected_tensors(CausalLM(cfg, opts.torch_dtype))
    with GGUFFile(path) as g:
        return info_lines(g, shapes, opts.torch_dtype) if g.quantized else []
