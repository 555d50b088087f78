"""Causal (optionally sliding-window) GQA attention through PyTorch's fused SDPA.

On CPU this dispatches to the flash kernel, which never materialises the (S, S) score matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sliding_mask(seq_len: int, window: int | None, device: torch.device) -> Tensor | None:
    """Bool (S, S) mask, True = attend: causal and within `window` (j > i - window, as HF).
    None when plain causal attention is the same thing (no window, or window >= S)."""
    if window is None or window >= seq_len:
        return None
    i = torch.arange(seq_len, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, causal: bool = True
) -> Tensor:
    """q (B, H, S, D), k/v (B, KV, T, D) -> (B, H, S, D). Causal unless an explicit mask is
    given; `causal=False` for single-token decoding against a KV cache."""
    if mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal and q.shape[2] > 1, scale=scale, enable_gqa=True
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
