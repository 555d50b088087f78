"""Write a (merged) model as a llama.cpp GGUF file, the way llama.cpp's convert_hf_to_gguf.py
writes the same HF checkpoint.

What the converter does, and so what we do (mesp/loading/gguf.py undoes each on the way in):
- tensor names come from gguf-py's own `TensorNameMap` for the architecture (HF -> GGUF);
- the q/k rows of LlamaModel's subclasses (llama, Mistral as arch llama, Granite, SmolLM3) are
  permuted per head (`LlamaModel.permute`: ggml's rope pairs adjacent dims, HF's the halves);
- Gemma 2 and 3 norms are stored as 1 + w (`Gemma2Model.modify_tensors`, `Gemma3Model.norm_shift`);
- what llama.cpp fixes in code instead of reading a key (Gemma 2's rope base and scale, SmolLM3's
  NoPE step, Mistral's missing window) must match, else the model is refused (`check_writable`);
- Llama 3 rope scaling becomes a `rope_freqs.weight` tensor of per-frequency divisors
  (`LlamaModel.generate_extra_tensors`); Phi-3's LongRoPE factor sets become
  `rope_factors_long` / `rope_factors_short` with its attention factor as a key
  (`Phi3MiniModel.generate_extra_tensors`); Phi-3's fused qkv / gate_up are written as they are
  (attn_qkv, ffn_up holding gate | up);
- 1-D tensors and norms stay F32; 2-D ones take the chosen type, and a row length that the
  block size does not divide falls back to F16 (the converter's fallback);
- the k-quant types (q4_k_m, q5_k_m, q6_k) are what llama-quantize would make of that file:
  its per-tensor type mix and shape fallbacks (gguf_mix), its block quantizers (gguf_kquant).
The file is streamed: every tensor's name, shape and type (so its byte size) follow from its
shape alone, so the header, keys and tensor infos are written first, then each tensor is made
(merged, permuted, quantized) right before its bytes are written and dropped after: the peak is
the model plus one tensor's working set, not the model plus every output.
The hyperparameter keys are those `TextModel.set_gguf_parameters` and the per-family classes
write; the tokenizer keys come from `gguf_vocab`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType as FT

from mesp.atomic_io import atomic_write
from mesp.config import FULL, SLIDING, ModelConfig
from mesp.convert.gguf_mix import MIXES, mix_type, quantize
from mesp.convert.gguf_spm import KV
from mesp.errors import MespError
from mesp.ops.rope import rot_dim

# --gguf-type -> (tensor type of 2-D weights, general.file_type)
GGUF_TYPES = {
    "f32": (QT.F32, FT.ALL_F32),
    "f16": (QT.F16, FT.MOSTLY_F16),
    "bf16": (QT.BF16, FT.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, FT.MOSTLY_Q8_0),
    "q4_0": (QT.Q4_0, FT.MOSTLY_Q4_0),
    **MIXES,  # a mix: the file type's own tensor type, others per tensor (gguf_mix)
}
# the default per --dtype: the merged model's own precision
DEFAULT_TYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    # convert_hf_to_gguf registers MistralForCausalLM under LlamaModel: arch "llama"
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "granite": gguf.MODEL_ARCH.GRANITE,
    "smollm3": gguf.MODEL_ARCH.SMOLLM3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
# families written by LlamaModel subclasses: q/k rows permuted (llama.cpp's interleaved rope),
# vocab size and rope dimension count as keys
PERMUTED = ("llama", "mistral", "granite", "smollm3")
# architectures with a rope_freqs tensor (Llama 3 rope scaling) in llama.cpp
ROPE_FREQS = ("llama", "mistral", "smollm3")
# families whose RMSNorm scales by 1 + w, stored as 1 + w by the converter
NORM_SHIFTED = ("gemma3", "gemma2")


def check_writable(cfg: ModelConfig) -> None:
    """Refuse, in one line, a model whose math llama.cpp's architecture for it cannot express
    (the file would load there and compute something else)."""
    n = cfg.num_hidden_layers
    if cfg.family == "mistral" and (cfg.sliding_window or math.inf) < cfg.max_position_embeddings:
        raise MespError(
            f"a Mistral with sliding_window {cfg.sliding_window} has no llama.cpp GGUF form: "
            "the converter writes it as arch llama, which attends to the whole context"
        )
    if cfg.family == "smollm3":  # llama.cpp: every 4th layer NoPE, no window (fixed in code)
        if cfg.rope_layers != [(i + 1) % 4 != 0 for i in range(n)]:
            raise MespError("a SmolLM3 GGUF has NoPE on every 4th layer only (llama.cpp's step)")
        if SLIDING in cfg.layer_types:
            raise MespError("a SmolLM3 GGUF has no sliding window (llama.cpp's smollm3)")
    if cfg.family == "granite" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise MespError("a Granite GGUF has no head_dim key: GraniteModel drops it (hidden/heads)")
    if cfg.family == "olmo2" and SLIDING in cfg.layer_types:
        raise MespError("an OLMo 2 GGUF has no sliding window")
    if cfg.family == "phi3":
        check_phi3(cfg)
    if cfg.family == "gemma2":
        # Gemma2Model writes no rope base, and llama.cpp fixes the scale and layer pattern
        assumed = cfg.hidden_size // cfg.num_attention_heads if n == 46 else cfg.head_dim
        if cfg.rope[FULL].theta != 10000.0 or cfg.rope[FULL].kind != "default":
            raise MespError("a Gemma 2 GGUF has no rope key: llama.cpp assumes theta 10000")
        if (cfg.query_pre_attn_scalar or cfg.head_dim) != assumed:
            raise MespError(
                f"Gemma 2's query_pre_attn_scalar {cfg.query_pre_attn_scalar:g} has no GGUF key: "
                f"llama.cpp scales by 1/sqrt({assumed})"
            )
        if cfg.layer_types != [SLIDING if i % 2 == 0 else FULL for i in range(n)]:
            raise MespError("a Gemma 2 GGUF slides on even layers only (llama.cpp's pattern)")
        if not (cfg.attn_logit_softcapping and cfg.final_logit_softcapping):
            raise MespError("a Gemma 2 GGUF needs both soft-caps (llama.cpp always applies them)")


def phi3_attn_factor(cfg: ModelConfig) -> float:
    """The attention factor Phi3MiniModel writes: from max_position / original context."""
    r = cfg.rope[FULL]
    scale = cfg.max_position_embeddings / r.original_max_position_embeddings
    return (
        math.sqrt(1 + math.log(scale) / math.log(r.original_max_position_embeddings))
        if (scale > 1.0)
        else 1.0
    )


def check_phi3(cfg: ModelConfig) -> None:
    """Phi3MiniModel writes no head_dim (llama.cpp takes hidden / heads, and the rotary dims
    from it) and derives LongRoPE's attention factor from the context lengths."""
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise MespError("a Phi-3 GGUF has no head_dim key: llama.cpp takes hidden / heads")
    r = cfg.rope[FULL]
    if phi3_rope_dims(cfg) != rot_dim(r, cfg.head_dim):
        raise MespError(
            f"a Phi-3 GGUF rotates int(factor·hidden)//heads = {phi3_rope_dims(cfg)} dims per "
            f"head, this model {rot_dim(r, cfg.head_dim)}"
        )
    if r.kind == "longrope" and not math.isclose(r.attention_factor, phi3_attn_factor(cfg)):
        raise MespError(
            f"a Phi-3 GGUF has LongRoPE's attention factor from the context lengths "
            f"({phi3_attn_factor(cfg):.6g}), not {r.attention_factor:.6g}"
        )


def phi3_rope_dims(cfg: ModelConfig) -> int:
    """The rotary dims Phi3MiniModel writes: int(partial_rotary_factor · hidden) // heads."""
    r = cfg.rope[FULL]
    return int(r.partial_rotary_factor * cfg.hidden_size) // cfg.num_attention_heads


def phi3_rope_factors(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's two factor sets, float32."""
    r = cfg.rope[FULL]
    if cfg.family != "phi3" or r.kind != "longrope":
        return {}
    return {
        "rope_factors_long.weight": np.asarray(r.long_factor, dtype=np.float32),
        "rope_factors_short.weight": np.asarray(r.short_factor, dtype=np.float32),
    }


def gguf_names(cfg: ModelConfig, hf_names: Iterable[str]) -> dict[str, str]:
    """HF tensor name -> llama.cpp's, by gguf-py's map for this architecture."""
    tmap = gguf.get_tensor_name_map(ARCHS[cfg.family], cfg.num_hidden_layers)
    out = {}
    for name in hf_names:
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise MespError(f"tensor {name} has no llama.cpp name for {cfg.family}")
        out[name] = new
    return out


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def to_llama_cpp(gguf_name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The converter's edits of one float32 tensor (see the module docstring)."""
    if cfg.family in PERMUTED and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        w = permute_rows(w, cfg.num_attention_heads)
    if cfg.family in PERMUTED and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        w = permute_rows(w, cfg.num_key_value_heads)
    if cfg.family in NORM_SHIFTED and gguf_name.endswith("norm.weight"):
        w = w + np.float32(1.0)
    return w


def storage_type(gguf_name: str, shape: tuple[int, ...], want: QT) -> QT:
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or want == QT.F32:
        return QT.F32
    block = gguf.GGML_QUANT_SIZES[want][0]
    return want if shape[-1] % block == 0 else QT.F16


def llama3_rope_freqs(cfg: ModelConfig) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: Meta's llama3 frequency divisors, one per rotary pair."""
    r = cfg.rope[FULL]
    if r.kind != "llama3":
        return None
    dim = cfg.head_dim
    freqs = 1.0 / r.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    old = r.original_max_position_embeddings
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smooth = np.clip(smooth, 0.0, 1.0)  # 0 -> divide by factor, 1 -> keep the frequency
    return (1.0 / ((1 - smooth) / r.factor + smooth)).astype(np.float32)


def add_hparams(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.family != "gemma2":  # Gemma2Model writes no rope base (checked: 10000)
        w.add_rope_freq_base(cfg.rope[FULL].theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.family in PERMUTED:  # LlamaModel: vocab size, head_dim as the rope dimension count
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)
    elif cfg.family == "phi3":  # Phi3MiniModel: the rotary dims, original context, window (0:
        # none), LongRoPE's attention factor; no head_dim, no vocab size
        r = cfg.rope[FULL]
        w.add_rope_dimension_count(phi3_rope_dims(cfg))
        long = r.kind == "longrope"
        w.add_rope_scaling_orig_ctx_len(
            r.original_max_position_embeddings if long else cfg.max_position_embeddings
        )
        w.add_sliding_window(cfg.sliding_window or 0)
        if long:
            w.add_rope_scaling_attn_factors(phi3_attn_factor(cfg))
    else:  # TextModel writes head_dim as key/value length when the config has one
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    rope = cfg.rope[FULL]
    if rope.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.factor)
    elif rope.kind == "llama3" and cfg.family not in ROPE_FREQS:
        raise MespError(f"llama3 rope scaling has no GGUF form for {cfg.family}")
    elif rope.kind == "longrope" and cfg.family != "phi3":
        raise MespError(f"longrope has no GGUF form for {cfg.family}")
    if cfg.family == "granite":  # GraniteModel: the multipliers as *_scale, each when non-zero
        for value, add in (
            (cfg.attention_multiplier, w.add_attention_scale),
            (cfg.embedding_multiplier, w.add_embedding_scale),
            (cfg.residual_multiplier, w.add_residual_scale),
            (cfg.logits_scaling, w.add_logit_scale),
        ):
            if value:
                add(value)
    if cfg.family == "gemma2":  # Gemma2Model's three keys
        assert cfg.attn_logit_softcapping and cfg.final_logit_softcapping  # check_writable
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window or cfg.max_position_embeddings)
    if cfg.family == "gemma3":
        w.add_rope_freq_base_swa(cfg.rope[SLIDING].theta)
        if cfg.sliding_window is not None:
            w.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        n = cfg.num_hidden_layers
        sliding = [t == SLIDING for t in cfg.layer_types]
        if sliding != [(i + 1) % 6 != 0 for i in range(n)]:  # llama.cpp's built-in pattern
            w.add_sliding_window_pattern(sliding)
        # llama.cpp scales Gemma 3 attention by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for
        # 27B); a model whose query_pre_attn_scalar says otherwise gets the scale as a key
        qpas = cfg.query_pre_attn_scalar or cfg.head_dim
        assumed = cfg.hidden_size // cfg.num_attention_heads if n == 62 else cfg.head_dim
        if qpas != assumed:
            w.add_attention_scale(1.0 / math.sqrt(qpas))


# a tensor not made yet: its (HF) shape, and what makes it (in any float dtype)
Make = Callable[[], torch.Tensor]
LazyTensor = tuple[tuple[int, ...], Make]


def write_model_gguf(
    cfg: ModelConfig,
    tensors: Mapping[str, LazyTensor],
    vocab: list[KV],
    out: Path,
    gguf_type: str,
    name: str,
) -> None:
    """Write HF-named `tensors` of a `cfg` model to `out` (atomically), making each one only
    when its bytes are due (see the module docstring)."""
    if gguf_type not in GGUF_TYPES:
        raise MespError(f"--gguf-type {gguf_type!r}: choose from {', '.join(GGUF_TYPES)}")
    want, ftype = GGUF_TYPES[gguf_type]
    check_writable(cfg)
    if cfg.tie_word_embeddings:  # llama.cpp reuses token_embd when output.weight is absent
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    names = gguf_names(cfg, tensors)
    tied = "output.weight" not in names.values()  # llama.cpp's test for tied embeddings
    # (gguf name, shape, type, maker of the stored array), in file order
    plan: list[tuple[str, tuple[int, ...], QT, Callable[[], np.ndarray]]] = []
    for hf_name, (shape, make) in tensors.items():
        gname = names[hf_name]
        if gguf_type in MIXES:
            qtype = mix_type(gname, tuple(shape), gguf_type, cfg.num_hidden_layers, tied)
        else:
            qtype = storage_type(gname, tuple(shape), want)

        def stored(gname: str = gname, make: Make = make, qtype: QT = qtype) -> np.ndarray:
            w32 = to_llama_cpp(gname, make().detach().float().cpu().numpy(), cfg)
            return quantize(w32, qtype)

        plan.append((gname, tuple(shape), qtype, stored))
    freqs = llama3_rope_freqs(cfg)
    if freqs is not None:
        plan.append(("rope_freqs.weight", freqs.shape, QT.F32, lambda: freqs))
    for gname, factors in phi3_rope_factors(cfg).items():
        plan.append((gname, factors.shape, QT.F32, lambda f=factors: f))

    def write(path: str) -> None:
        w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCHS[cfg.family]])
        try:
            w.add_type(gguf.GGUFType.MODEL)
            w.add_name(name)
            add_hparams(w, cfg)
            w.add_file_type(ftype)
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for kv in vocab:
                w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub)
            sizes = []
            for gname, shape, qtype, _ in plan:
                nbytes = math.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
                # a non-uint8 dtype: `shape` is taken as the element shape, not the byte shape
                w.add_tensor_info(gname, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
                sizes.append(nbytes)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for (gname, _, _, make), nbytes in zip(plan, sizes, strict=True):
                data = make()
                if data.nbytes != nbytes:  # the tensor info already promised nbytes
                    raise MespError(f"{gname}: made {data.nbytes} bytes, expected {nbytes}")
                w.write_tensor_data(data)  # pads to the alignment before and after
                del data
        finally:
            w.close()

    atomic_write(out, write)
