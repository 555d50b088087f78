"""Tiny transformers models of each family with non-round sizes, and the same model in mesp.

Shared by the parity, PEFT and engine tests: transformers is the independent oracle.
"""

from __future__ import annotations

import torch

from mesp.config import ModelConfig
from mesp.loading.build import TensorSource, build_model
from mesp.models.transformer import CausalLM
from mesp.quant import QuantSpec

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "mistral",
    "smollm3",
    "granite",
    "olmo2",
    "gemma2",
    "phi3",
)
LATER = ("mistral", "smollm3", "granite", "olmo2", "gemma2", "phi3")  # issue 29's: slow-suite cases

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


def lora_names(family: str, names: list[str]) -> list[str]:
    """PEFT target names as they exist on the family's HF model: Phi-3 fuses q/k/v and gate/up
    (mesp.models.transformer.FUSED_TARGETS), so a part stands for its fused linear there."""
    if family != "phi3":
        return names
    from mesp.models.transformer import FUSED_TARGETS

    fused = {p: f for f, parts in FUSED_TARGETS.items() for p in parts}
    return sorted({fused.get(n, n) for n in names})


def n_lora(family: str) -> int:
    """LoRA linears per layer under the default targets: 7, Phi-3's fused 4."""
    return 4 if family == "phi3" else 7


def n_patched(family: str) -> int:
    """Modules mesp.patch changes per layer: the LoRA linears and the MLP, which becomes one
    FusedLoRAMLP; Phi-3's MLP (one fused gate_up_proj) stays transformers' own."""
    return n_lora(family) + (family != "phi3")


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
    if family == "mistral":  # a window (5) shorter than every test sequence, on every layer
        kw.setdefault("sliding_window", 5)
        return tf.MistralConfig(tie_word_embeddings=False, rope_theta=6000.0, **kw)
    if family == "smollm3":  # odd layers are NoPE, and with use_sliding_window they slide too
        kw.setdefault("no_rope_layers", [1 - i % 2 for i in range(kw["num_hidden_layers"])])
        kw.setdefault("sliding_window", 5)
        kw.setdefault("use_sliding_window", True)
        specials = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # in the tiny vocab
        return tf.SmolLM3Config(tie_word_embeddings=True, rope_theta=8000.0, **specials, **kw)
    if family == "granite":  # every multiplier away from 1 so that each is tested
        scalars = dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.4,
            attention_multiplier=0.07,
            logits_scaling=2.5,
        )
        return tf.GraniteConfig(tie_word_embeddings=True, rope_theta=3000.0, **{**scalars, **kw})
    if family == "olmo2":  # post-branch norms, q/k norms over the whole projection (perturbed)
        specials = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # in the tiny vocab
        rope = {"rope_type": "default", "rope_theta": 4000.0}
        return tf.Olmo2Config(tie_word_embeddings=False, rope_parameters=rope, **specials, **kw)
    if family == "phi3":  # Phi-4-mini's shape in small: partial rotary, LongRoPE, a window
        return tf.Phi3Config(**{**phi3_extras(kw), **kw})
    kw.setdefault("sliding_window", 5)
    if family == "gemma2":  # caps near the tiny model's score / logit sizes, so tanh bends;
        # layer_types: transformers' own default alternation (sliding, full, sliding, ...)
        caps = dict(attn_logit_softcapping=0.05, final_logit_softcapping=0.3)
        return tf.Gemma2Config(
            query_pre_attn_scalar=20,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_implementation="eager",
            **{**caps, **kw},
        )
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


def phi3_extras(kw: dict, original: int = 16) -> dict:  # type: ignore[type-arg]
    """Phi-3's pieces at tiny size: 3/4 of each head rotates (Phi-4-mini's factor), LongRoPE
    with distinct short and long factors (the long ones past `original` positions, which test
    sequences pass) and the attention factor from max_position / original, a window of 5.
    Phi3Config checks the factor lists against hidden / heads but its rope init sizes them by
    head_dim: where the two differ transformers builds no LongRoPE, so the rope is plain."""
    head_dim = kw["head_dim"]
    n = len(range(0, int(head_dim * 0.75), 2))
    rope: dict = {"rope_type": "default", "rope_theta": 7000.0, "partial_rotary_factor": 0.75}  # type: ignore[type-arg]
    if head_dim == kw["hidden_size"] // kw["num_attention_heads"]:
        rope.update(
            rope_type="longrope",
            short_factor=[1.0 + 0.1 * i for i in range(n)],
            long_factor=[1.5 + 0.7 * i for i in range(n)],
        )
    specials = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # in the tiny vocab
    return dict(
        tie_word_embeddings=False,
        rope_parameters=rope,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=original,
        sliding_window=5,
        **specials,
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
