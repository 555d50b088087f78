"""`mesp info`: architecture, dimensions, parameter counts and weight bytes, from the config."""

from __future__ import annotations

import torch

from mesp.config import ModelConfig
from mesp.lora import lora_param_count
from mesp.models.linear import FrozenWeight
from mesp.models.transformer import LORA_TARGETS, CausalLM
from mesp.quant import QuantSpec, quantized_bytes
from mesp.session import ModelOptions, open_model


def config_of(opts: ModelOptions) -> ModelConfig:
    """The config alone where the format allows (no weights read)."""
    from pathlib import Path

    from mesp.loading.zoo import random_shape, resolve

    if opts.model.startswith("random:"):
        return random_shape(opts.model)
    path = Path(resolve(opts.model) or opts.model)
    if path.is_dir():
        return ModelConfig.from_file(path / "config.json")
    return open_model(ModelOptions(model=str(path), quantize="none")).model.config


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
    wb = weight_bytes(cfg, opts.quant or QuantSpec(), opts.torch_dtype)
    with torch.device("meta"):
        lora_n = lora_param_count(CausalLM(cfg, opts.torch_dtype), rank, targets)
    mb = 2**20
    q = opts.quant or QuantSpec()
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
    lines += [
        f"parameters   {wb['params']:,}",
        f"weights      {wb['dense_bytes'] / mb:,.1f} MB in {opts.dtype}, "
        f"{wb['quant_bytes'] / mb:,.1f} MB at {q.bits}-bit group {q.group_size}",
        f"LoRA         {lora_n:,} parameters at rank {rank} on {','.join(targets)} "
        f"({lora_n * 4 / mb:.2f} MB fp32)",
    ]
    return "\n".join(lines)
