"""Rotary position embedding (HF's rotate-half convention), forward and hand backward."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mesp.config import RopeSpec


def inv_freq(spec: RopeSpec, head_dim: int) -> Tensor:
    """(D/2,) float32 inverse frequencies, with linear or Llama-3 scaling applied."""
    f = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
    """cos, sin: (S, D) in dtype; frequencies duplicated over both halves as HF does."""
    f = inv_freq(spec, head_dim).to(device)
    t = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    ang = torch.outer(t, f)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, S, D), cos/sin (S, D) -> (B, H, S, D). y = x·c + R(x)·s, R(x) = [-x₂, x₁]."""
    return x * cos + _rotate_half(x) * sin


def apply_rope_backward(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """dx = dy·c + Rᵀ(dy·s), with Rᵀ(u) = [u₂, -u₁] (R is a rotation by 90°, so Rᵀ = -R).
    Equivalently the inverse rotation: apply_rope(dy, cos, -sin). Shapes as apply_rope."""
    return dy * cos - _rotate_half(dy * sin)
