"""RMSNorm, forward and hand backward.

Forward (all families): y = x̂ · (w + offset), x̂ = x · r, r = (mean(x²) + eps)^-½, computed in
float32 and cast back (Gemma3 uses offset 1, i.e. the (1+w) form; the rest offset 0).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Math dtype: float32 for half types, float64 stays float64 (for exact gradchecks)."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: Tensor, w: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """x (..., D), w (D) -> (..., D) in x.dtype."""
    x32 = x.to(_acc(x.dtype))
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    g = w.to(x32.dtype) + offset if offset else w.to(x32.dtype)
    return (x32 * r * g).to(x.dtype)


def rms_norm_backward(dy: Tensor, x: Tensor, w: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """dx for frozen w. With u = dy·g (g = w + offset):
    dx = r · (u − x̂ · mean(u · x̂)), since ∂x̂_i/∂x_j = r(δ_ij − x̂_i x̂_j / D).
    Shapes: dy, x (..., D) -> dx (..., D) in x.dtype; math in float32."""
    x32 = x.to(_acc(x.dtype))
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x32 * r  # not in place: x.float() is x itself for fp32 input
    u = dy.to(x32.dtype) * (w.to(x32.dtype) + offset if offset else w.to(x32.dtype))
    dot = (u * xhat).mean(-1, keepdim=True)
    return (u - xhat * dot).mul_(r).to(x.dtype)


def _heads_stats(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (B, H, S, D), w (H·D) -> x32, r (B, 1, S, 1) and g (H, 1, D): one RMS per token,
    taken over all H·D values; w is laid out head-major as the projection's output."""
    h, d = x.shape[1], x.shape[3]
    x32 = x.to(_acc(x.dtype))
    r = torch.rsqrt(x32.pow(2).mean((1, 3), keepdim=True) + eps)
    return x32, r, w.to(x32.dtype).view(h, 1, d)


def rms_norm_heads(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """OLMo 2's q/k norm: an RMSNorm over the whole projection of a token (H·D values), applied
    to it already split into heads. x (B, H, S, D), w (H·D) -> (B, H, S, D) in x.dtype.
    Equal to rms_norm on the (B, S, H·D) layout; kept in head layout so the tape and the
    attention need no transposes."""
    x32, r, g = _heads_stats(x, w, eps)
    return (x32 * r * g).to(x.dtype)


def rms_norm_heads_backward(dy: Tensor, x: Tensor, w: Tensor, eps: float) -> Tensor:
    """dx of rms_norm_heads for frozen w. The same derivation as rms_norm_backward with the
    token's N = H·D values as its vector: x̂ = x·r, r = (Σ_{h,d} x²/N + eps)^-½, so
    ∂x̂_i/∂x_j = r(δ_ij − x̂_i x̂_j / N) for i, j over (h, d) of one token, and with u = dy·g
    dx = r · (u − x̂ · mean_{h,d}(u · x̂)). No term couples tokens or batch rows.
    Shapes: dy, x (B, H, S, D), w (H·D) -> dx (B, H, S, D) in x.dtype; math in float32."""
    x32, r, g = _heads_stats(x, w, eps)
    xhat = x32 * r
    u = dy.to(x32.dtype) * g
    dot = (u * xhat).mean((1, 3), keepdim=True)
    return (u - xhat * dot).mul_(r).to(x.dtype)
