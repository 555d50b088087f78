"""Tiny transformers models of each family with non-round sizes, and the same model in mesp.

Shared by the parity, PEFT and engine tests: transformers is the independent oracle.
"""

from __future__ import annotations

import torch

from mesp.config import ModelConfig
from mesp.loading.build import TensorSource, build_model
from mesp.models.transformer import CausalLM
from mesp.quant import QuantSpec

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")

BASE = dict(
    vocab_size=211,
    hidden_size=72,
    intermediate_size=136,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=24,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def hf_config(family: str, **over):  # type: ignore[no-untyped-def]
    import transformers as tf

    kw = {**BASE, **over}
    if family == "llama":
        kw.setdefault(
            "rope_parameters",
            {
                "rope_type": "llama3",
                "rope_theta": 5000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        return tf.LlamaConfig(tie_word_embeddings=False, **kw)
    if family == "qwen2":
        return tf.Qwen2Config(tie_word_embeddings=True, rope_theta=7000.0, **kw)
    if family == "qwen3":
        return tf.Qwen3Config(tie_word_embeddings=False, rope_theta=9000.0, **kw)
    kw.setdefault("sliding_window", 5)
    kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
    return tf.Gemma3TextConfig(
        query_pre_attn_scalar=20,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        **kw,
    )


def hf_model(family: str, seed: int = 0, **over):  # type: ignore[no-untyped-def]
    """A random transformers model whose norms are perturbed too (so their use is tested)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family, **over), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


def mesp_from_hf(hf, quant: QuantSpec | None = None, dtype=torch.float32) -> CausalLM:  # type: ignore[no-untyped-def]
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return build_model(cfg, TensorSource(sd.keys(), sd.__getitem__, "hf-test"), dtype, quant)
