"""Rotary position embedding (HF's rotate-half convention), forward and hand backward.

Partial rotary (Phi-4-mini's partial_rotary_factor): the tables cover the first rot_dim dims of
a head only; those rotate, the rest pass through unchanged (forward and backward alike).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mesp.config import RopeSpec


def rot_dim(spec: RopeSpec, head_dim: int) -> int:
    """The dims of a head that rotate: int(D·partial_rotary_factor), as transformers takes it."""
    return int(head_dim * spec.partial_rotary_factor)


def inv_freq(spec: RopeSpec, head_dim: int, seq_len: int = 0) -> Tensor:
    """(rot_dim/2,) float32 inverse frequencies, with linear, Llama-3 or LongRoPE scaling
    applied. LongRoPE (Phi-3): the long factors when the sequence (all positions, the cached
    ones too) is longer than original_max_position_embeddings, else the short ones, as
    transformers' longrope_frequency_update picks them."""
    dim = rot_dim(spec, head_dim)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if spec.kind == "longrope":
        long = seq_len > spec.original_max_position_embeddings
        ext = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float32)
        return 1.0 / (ext * spec.theta**shape)
    f = 1.0 / (spec.theta**shape)
    if spec.kind == "linear":
        return f / spec.factor
    if spec.kind == "llama3":
        # Llama 3.1+: long wavelengths slowed by `factor`, short kept, a smooth ramp between.
        old = spec.original_max_position_embeddings
        low_wl, high_wl = old / spec.low_freq_factor, old / spec.high_freq_factor
        wl = 2 * math.pi / f
        scaled = torch.where(wl > low_wl, f / spec.factor, f)
        smooth = (old / wl - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        mid = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wl >= high_wl) & (wl <= low_wl)
        return torch.where(medium, mid, scaled)
    return f


def rope_tables(
    spec: RopeSpec, head_dim: int, seq_len: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin: (S, rot_dim) in dtype; frequencies duplicated over both halves as HF does,
    times LongRoPE's attention factor (1.0 otherwise) in float32 before the cast, as HF."""
    f = inv_freq(spec, head_dim, seq_len).to(device)
    t = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    ang = torch.outer(t, f)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if spec.attention_factor != 1.0:
        cos, sin = cos * spec.attention_factor, sin * spec.attention_factor
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, S, D), cos/sin (S, R), R <= D -> (B, H, S, D). The first R dims:
    y = x·c + R(x)·s, R(x) = [-x₂, x₁]; the other D - R pass through (partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    xr = x[..., :r]
    return torch.cat([xr * cos + _rotate_half(xr) * sin, x[..., r:]], dim=-1)


def apply_rope_backward(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """dx = dy·c + Rᵀ(dy·s), with Rᵀ(u) = [u₂, -u₁] (R is a rotation by 90°, so Rᵀ = -R).
    Equivalently the inverse rotation: apply_rope(dy, cos, -sin). The pass-through dims of a
    partial rotary are the identity: their gradient passes unchanged. Shapes as apply_rope."""
    r = cos.shape[-1]
    if r == dy.shape[-1]:
        return dy * cos - _rotate_half(dy * sin)
    dr = dy[..., :r]
    return torch.cat([dr * cos - _rotate_half(dr * sin), dy[..., r:]], dim=-1)
