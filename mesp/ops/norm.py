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
