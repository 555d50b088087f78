"""FamilySpec: the handful of flags that tell one decoder family from another."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilySpec:
    name: str
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's (1 + w)
    sandwich_norms: bool = False  # norms after attention and MLP too, 4 per block (Gemma3)
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden) (Gemma)
    # OLMo 2: q/k RMSNorm over the whole projection (all heads of a token: H·D values)
    qk_norm_whole: bool = False
    # OLMo 2: no input norm; one norm on the attention output and one on the MLP output, each
    # before its residual add (the MLP reads the residual stream unnormed)
    post_norms: bool = False
    # Phi-3: one qkv_proj (q | k | v) and one gate_up_proj (gate | up) instead of five linears
    fused_proj: bool = False
