"""How a llama.cpp GGUF maps onto HF's model: the architectures read, the tensor names per
block and family, the HF config built from the GGUF metadata (Llama 3's rope scaling recovered
from the baked `rope_freqs`, Phi-3's LongRoPE from `rope_factors_long` / `_short`), and the
converter's tensor edits undone (the interleaved rotary halves of LlamaModel's subclasses,
Gemma's 1 + w norm scales), so a GGUF loads as transformers loads it; hyperparameters llama.cpp
fixes in code (Gemma 2's scale and layer pattern, SmolLM3's NoPE step) are filled in as
llama.cpp assumes them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mesp.errors import MespError

ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "gemma2": "gemma2",
    "olmo2": "olmo2",
    "granite": "granite",
    "smollm3": "smollm3",
    "phi3": "phi3",
}
# converted by LlamaModel subclasses: q/k rows permuted for llama.cpp's interleaved rope
PERMUTED = ("llama", "granite", "smollm3")
GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    **{f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"ffn_{x}.weight": f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")},
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Gemma 2 and 3 have four norms per block; llama.cpp names the pre-MLP one ffn_norm like llama's.
GEMMA_LAYER = {
    **LAYER,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_CORE = [
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_norm",
]
_QK_NORM = ["attn_q_norm", "attn_k_norm"]
# OLMo 2 normalizes each branch's output instead of its input, and q/k over whole projections
OLMO_LAYER = {
    **{k: v for k, v in LAYER.items() if k not in ("attn_norm.weight", "ffn_norm.weight")},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3: fused q | k | v and gate | up, written as they are (attn_qkv; ffn_up holds gate | up)
PHI3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
REQUIRED = {
    "llama": _CORE,
    "qwen2": _CORE,
    "qwen3": _CORE + _QK_NORM,
    "gemma3": _CORE + _QK_NORM + ["post_attention_norm", "post_ffw_norm"],
    "gemma2": _CORE + ["post_attention_norm", "post_ffw_norm"],
    "granite": _CORE,
    "smollm3": _CORE,
    "olmo2": [n for n in _CORE if n not in ("attn_norm", "ffn_norm")]
    + _QK_NORM
    + ["post_attention_norm", "post_ffw_norm"],
    "phi3": [k.removesuffix(".weight") for k in PHI3_LAYER],
}
NORM_SHIFTED = ("gemma3", "gemma2")


def shown(name: str) -> str:
    """A tensor name as an error message shows it: quoted, escaped, at most 64 characters (a
    corrupt file's name may hold newlines or megabytes, and errors stay one line)."""
    return repr(name if len(name) <= 64 else name[:64] + "...")


def hf_config(meta: dict[str, Any], infos: dict[str, Any], arch: str, where: str) -> dict:
    def get(key: str, default: Any = ...) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            if default is ...:
                raise MespError(f"{where}: missing metadata key '{full}'")
            return default
        return meta[full]

    if "token_embd.weight" not in infos:
        raise MespError(f"{where}: missing tensor 'token_embd.weight'")

    def positive(key: str, value: Any) -> int:  # sizes divide and index: 0 is a corrupt file
        if int(value) <= 0:
            raise MespError(f"{where}: metadata key '{arch}.{key}' must be positive, got {value}")
        return int(value)

    hidden = positive("embedding_length", get("embedding_length"))
    heads = positive("attention.head_count", get("attention.head_count"))
    # head_dim: explicit key_length (qwen3, gemma3), else rope dims (llama), else hidden/heads.
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
    positive("attention.key_length (head_dim)", head_dim)
    cfg: dict[str, Any] = {
        "model_type": ARCHS[arch],
        "vocab_size": infos["token_embd.weight"].shape[0],  # rows the model actually has
        "hidden_size": hidden,
        "intermediate_size": positive("feed_forward_length", get("feed_forward_length")),
        "num_hidden_layers": positive("block_count", get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": positive(
            "attention.head_count_kv", get("attention.head_count_kv", heads)
        ),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 1e6 if arch == "gemma3" else 1e4)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in infos,
        "attention_bias": "blk.0.attn_q.bias" in infos,
        "hidden_act": "silu",
        "rope_scaling": None,
    }
    # A corrupt block_count (say 2**27) must fail here, not after listing 2**27 blocks' names.
    held = {int(b) for b in (n.split(".")[1] for n in infos if n.startswith("blk.")) if b.isdigit()}
    n = cfg["num_hidden_layers"]
    first = next((i for i in range(min(n, len(held) + 1)) if i not in held), None)
    if first is not None:
        raise MespError(
            f"{where}: missing tensor 'blk.{first}.{REQUIRED[arch][0]}.weight' (block_count "
            f"is {n}, the file holds {len(held)} blocks)"
        )
    for key, tok_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        cfg[f"{key}_token_id"] = meta.get(f"tokenizer.ggml.{tok_key}_token_id")
    kind = get("rope.scaling.type", "none")
    if kind != "none":
        cfg["rope_scaling"] = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
        if (orig := get("rope.scaling.original_context_length", None)) is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    if arch == "gemma3":
        n = cfg["num_hidden_layers"]
        pattern = get("attention.sliding_window_pattern", 6)  # llama.cpp's built-in default
        if isinstance(pattern, list):
            sliding = [bool(x) for x in pattern]
        else:
            every = positive("attention.sliding_window_pattern", pattern)
            sliding = [(i + 1) % every != 0 for i in range(n)]
        # llama.cpp: attention scale is 1/sqrt(hidden/heads) for 27B (62 layers), else head_dim.
        scale = get("attention.scale", None)
        del cfg["hidden_act"]
        cfg.update(
            {
                "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": int(get("attention.sliding_window")),
                "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
                "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
                "query_pre_attn_scalar": (
                    1.0 / scale**2 if scale else hidden // heads if n == 62 else head_dim
                ),
                "final_logit_softcapping": get("final_logit_softcapping", None),
                "attn_logit_softcapping": get("attn_logit_softcapping", None),
            }
        )
    if arch == "granite":  # llama.cpp's defaults: scale 1/sqrt(head_dim), others off (1)
        cfg.update(
            {
                "attention_multiplier": float(get("attention.scale", head_dim**-0.5)),
                "embedding_multiplier": float(get("embedding_scale", 1.0)),
                "residual_multiplier": float(get("residual_scale", 1.0)),
                "logits_scaling": float(get("logit_scale", 1.0)),
            }
        )
    if arch == "smollm3":  # llama.cpp: every 4th layer NoPE (n_no_rope_layer_step), no window
        n = cfg["num_hidden_layers"]
        cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(n)]
        cfg["use_sliding_window"] = False
    if arch == "phi3":
        cfg.update(phi3_config(get, hidden, heads))
    if arch == "gemma2":  # llama.cpp's LLM_ARCH_GEMMA2 hparams, their defaults where absent
        # sliding on even layers; scale 1/sqrt(head_dim), 1/sqrt(hidden/heads) at 27B (46)
        del cfg["hidden_act"]
        cfg.update(
            {
                "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": int(get("attention.sliding_window", 4096)),
                "layer_types": [
                    "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
                ],
                "query_pre_attn_scalar": hidden // heads if n == 46 else head_dim,
                "final_logit_softcapping": float(get("final_logit_softcapping", 30.0)),
                "attn_logit_softcapping": float(get("attn_logit_softcapping", 50.0)),
            }
        )
    return cfg


def phi3_config(get: Any, hidden: int, heads: int) -> dict[str, Any]:
    """Phi3MiniModel's keys: head_dim is hidden / heads (rope.dimension_count is the rotary
    part: partial_rotary_factor = it / head_dim), a window of 0 is none. LongRoPE's factor
    sets are tensors, read by the loader (phi3_rope_scaling)."""
    head_dim = hidden // heads
    rot = int(get("rope.dimension_count", head_dim))
    win = int(get("attention.sliding_window", 0))
    ctx = int(get("context_length"))
    return {
        "head_dim": head_dim,
        "partial_rotary_factor": rot / head_dim,
        "sliding_window": win or None,
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length", ctx)),
        "attention_factor": float(get("rope.scaling.attn_factor", 1.0)),
        "rope_scaling": None,
    }


def phi3_rope_scaling(long: np.ndarray, short: np.ndarray, cfg: dict, where: str) -> dict:
    """LongRoPE from llama.cpp's two factor tensors and the attention factor key."""
    n = len(range(0, int(cfg["head_dim"] * cfg["partial_rotary_factor"]), 2))
    if long.shape != (n,) or short.shape != (n,):
        raise MespError(f"{where}: rope_factors_long / rope_factors_short need {n} values each")
    return {
        "rope_type": "longrope",
        "rope_theta": cfg["rope_theta"],
        "long_factor": [float(x) for x in long],
        "short_factor": [float(x) for x in short],
        "attention_factor": cfg["attention_factor"],
        "partial_rotary_factor": cfg["partial_rotary_factor"],
    }


def llama3_rope_scaling(factors: np.ndarray, cfg: dict, where: str) -> dict | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's precomputed `rope_freqs` tensor.

    The converter bakes Meta's llama3 formula into per-frequency divisors. We try Meta's values
    (low 1, high 4, original 8192: every Llama 3.x), else fit low/high from the smoothly
    interpolated band, and accept the result only if it reproduces every stored divisor.
    """
    dim = cfg["head_dim"]
    inv_wavelen = 1.0 / cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_wavelen /= 2 * math.pi
    factor, orig = float(factors.max()), 8192
    if factor <= 1.0:
        return None

    def divisors(low: float, high: float) -> np.ndarray:
        smooth = np.clip((orig * inv_wavelen - low) / (high - low), 0.0, 1.0)
        return 1.0 / ((1 - smooth) / factor + smooth)

    low, high = 1.0, 4.0
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if (
        factors.shape == inv_wavelen.shape
        and not np.allclose(factors, divisors(low, high), rtol=1e-4)
        and mid.sum() >= 2
    ):
        # smooth = (orig / wavelen - low) / (high - low) is linear in 1 / wavelen.
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, icept = np.polyfit(inv_wavelen[mid], smooth, 1)
        low = float(-icept * orig / slope)
        high = low + float(orig / slope)
    if factors.shape != inv_wavelen.shape or not np.allclose(
        factors, divisors(low, high), rtol=1e-4
    ):
        raise MespError(f"{where}: rope_freqs tensor does not match Llama 3 rope scaling")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def undo_converter(name: str, w: np.ndarray, arch: str, cfg: dict, where: str) -> np.ndarray:
    """Reverse llama.cpp's convert_hf_to_gguf.py edits (see module docstring)."""
    if arch in PERMUTED and (".attn_q." in name or ".attn_k." in name):
        # LlamaModel.permute interleaves each head's rotary halves for ggml's GPT-J-style rope.
        n = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        if w.shape[0] % (2 * n):
            raise MespError(
                f"{where}: tensor {shown(name)} has {w.shape[0]} rows, not {n} rope heads"
            )
        w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    if arch in NORM_SHIFTED and name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # Gemma2/3Model store HF's (1 + w) RMSNorm scale; q/k norms too
    return w
