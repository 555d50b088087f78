"""Causal (optionally sliding-window) GQA attention: the autograd path, and a forward/backward pair
for hand-written engines that keeps only (out, lse) and never holds a full (S, S) score matrix.

CPU: PyTorch's flash kernels (`_scaled_dot_product_flash_attention_for_cpu[_backward]`). As of
torch 2.13 they take any (B, H, S, D) strides (e.g. a (B, S, H, D) buffer viewed transposed),
return `out` with q's layout and lse (B, H, S) stored S-major, handle GQA natively (query head h
reads kv head h // (H/KV)), accept fp64/fp32/bf16/fp16 (lse fp32, fp64 for fp64) and a *float*
additive mask (bool is rejected). `is_causal` is top-left aligned, as in `F.sdpa`. A masked call
does not skip fully masked blocks, so a sliding window costs as much as full attention.
Elsewhere (CUDA, MPS, or a torch without the op): an exact query-chunked fallback
(attention_chunked.py).
bf16 / fp16 on a CPU without a low-precision GEMM (`ops.matmul.computes_in_fp32`): the flash
kernels run on fp32 copies and out, dq, dk, dv are rounded once; the autograd path then goes
through the same forward / backward pair, so bp's attention gradients are mesp's.
A logit soft-cap (Gemma 2: cap·tanh(s/cap) on the scores) always takes the query-chunked pair,
under autograd too (_CappedAttention): the flash kernels have no cap.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.ops import attention_chunked
from mesp.ops.matmul import computes_in_fp32

_OPS = torch.ops.aten


def sliding_mask(seq_len: int, window: int | None, device: torch.device) -> Tensor | None:
    """Bool (S, S) mask, True = attend: causal and within `window` (j > i - window, as HF).
    None when plain causal attention is the same thing (no window, or window >= S)."""
    if window is None or window >= seq_len:
        return None
    i = torch.arange(seq_len, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: Tensor | None,
    causal: bool = True,
    softcap: float | None = None,
) -> Tensor:
    """q (B, H, S, D), k/v (B, KV, T, D) -> (B, H, S, D). Causal unless an explicit mask is
    given; `causal=False` for single-token decoding against a KV cache."""
    if softcap:
        if mask is None and not (causal and q.shape[2] > 1):  # every key (decoding)
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _CappedAttention.apply(q, k, v, scale, mask, softcap)
        return attention_chunked.chunked_fwd(q, k, v, scale, mask, 256, softcap)[0]
    if computes_in_fp32(q) and _use_flash(q, "auto"):
        causal = mask is None and causal and q.shape[2] > 1
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _Fp32Attention.apply(q, k, v, scale, mask, causal)
        return _flash_fwd(q, k, v, scale, mask, causal)[0]
    if q.is_meta and _cpu_flash()[1]:  # what CPU SDPA dispatches to (math would be L×L)
        m = None if mask is None else _flash_mask(mask, q.dtype)
        causal = mask is None and causal and q.shape[2] > 1
        return _OPS._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=m, scale=scale
        )[0]
    if mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal and q.shape[2] > 1, scale=scale, enable_gqa=True
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = attend) -> 0 / -inf in dtype, the only form the CPU flash kernel takes.
    Callers running many layers can build it once and pass it instead of the bool mask."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)


@functools.cache
def _cpu_flash() -> tuple[bool, bool]:
    """(kernel usable, GQA native), probed once on a tiny problem against an explicit reference,
    so an older torch that lacks the op or reads k/v with the query head index is caught."""
    if not hasattr(_OPS, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return False, False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 3, 4, generator=g) for n in (2, 1, 1))
    ref = attention(q, k.expand(1, 2, 3, 4), v.expand(1, 2, 3, 4), 0.5, None)

    def run(kk: Tensor, vv: Tensor) -> bool:
        try:
            fwd = _OPS._scaled_dot_product_flash_attention_for_cpu
            out, lse = fwd(q, kk, vv, 0.0, True, scale=0.5)
            _, dk, _ = _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
                out, q, kk, vv, out, lse, 0.0, True, scale=0.5
            )
        except RuntimeError:
            return False
        return dk.shape == kk.shape and torch.allclose(out, ref, atol=1e-5)

    if run(k, v):
        return True, True
    return run(k.expand(1, 2, 3, 4), v.expand(1, 2, 3, 4)), False


def _expand_kv(t: Tensor, heads: int) -> Tensor:
    """(B, KV, T, D) -> (B, H, T, D), kv head j serving query heads j·g … j·g + g − 1."""
    b, kv, n, d = t.shape
    return t.unsqueeze(2).expand(b, kv, heads // kv, n, d).reshape(b, heads, n, d)


def _use_flash(q: Tensor, impl: str) -> bool:
    if impl not in ("auto", "flash", "chunked"):
        raise ValueError(f"impl must be 'auto', 'flash' or 'chunked', got {impl!r}")
    return impl != "chunked" and q.device.type in ("cpu", "meta") and _cpu_flash()[0]


def _flash_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return mask if mask is None or mask.is_floating_point() else additive_mask(mask, dtype)


def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: Tensor | None,
    impl: str = "auto",
    chunk: int = 256,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """q (B, H, S, D), k/v (B, KV, S, D) -> out (B, H, S, D) in q.dtype, lse (B, H, S) in fp32
    (fp64 for fp64 input). Causal when mask is None, else exactly `mask` (bool, True = attend,
    or additive float), which must leave every query at least one key. `softcap`: scores
    cap·tanh(s/cap) (the chunked path, whatever impl says)."""
    if not softcap and _use_flash(q, impl):
        return _flash_fwd(q, k, v, scale, mask, mask is None)
    return attention_chunked.chunked_fwd(q, k, v, scale, mask, chunk, softcap)


def _flash_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, causal: bool
) -> tuple[Tensor, Tensor]:
    """The CPU flash forward (kv expanded where GQA is not native), on fp32 copies with out
    rounded back where the dtype computes in fp32."""
    up = computes_in_fp32(q)
    if up:
        q32, k, v = q.float(), k.float(), v.float()
    else:
        q32 = q
    native = _cpu_flash()[1]
    kx, vx = (k, v) if native else (_expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]))
    out, lse = _OPS._scaled_dot_product_flash_attention_for_cpu(
        q32, kx, vx, 0.0, causal, attn_mask=_flash_mask(mask, q32.dtype), scale=scale
    )
    return (out.to(q.dtype) if up else out), lse


def fwd_matches_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether `attention(q, k, v, scale, mask)` runs the very kernel call `attention_fwd` makes,
    so that their outputs are the same bits: both on the CPU flash kernel with native GQA, the
    same causal flag (S > 1), and a mask SDPA turns into the same 0 / -inf additive mask. A
    kept mesp tape may then stand in for the plain forward; elsewhere (CUDA, the chunked
    fallback, SDPA choosing its math kernel) the caller must not assume equal outputs."""
    if q.shape[2] < 2 or not _use_flash(q, "auto") or not _cpu_flash()[1]:
        return False
    if q.is_meta or computes_in_fp32(q):  # `attention` calls _flash_fwd itself there
        return True
    causal = mask is None
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, scale=1.0, enable_gqa=True)
    return choice == flash


def attention_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    mask: Tensor | None,
    impl: str = "auto",
    chunk: int = 256,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, H, S, D), dk/dv (B, KV, S, D) (summed over each kv head's query group), given the
    (out, lse) of `attention_fwd` with the same mask, scale and softcap (either impl's: lse
    layouts differ, but both backward paths read any strides)."""
    if not softcap and _use_flash(q, impl):
        return _flash_bwd(dout, q, k, v, out, lse, scale, mask, mask is None)
    return attention_chunked.chunked_bwd(dout, q, k, v, out, lse, scale, mask, chunk, softcap)


def _flash_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    mask: Tensor | None,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU flash backward; in fp32 (dq, dk, dv each rounded once) where _flash_fwd is."""
    dtype, kv = q.dtype, k.shape[1]
    up = computes_in_fp32(q)
    if up:
        dout, q, k, v, out = (t.float() for t in (dout, q, k, v, out))
    heads, native = q.shape[1], _cpu_flash()[1]
    kx, vx = (k, v) if native else (_expand_kv(k, heads), _expand_kv(v, heads))
    fmask = _flash_mask(mask, q.dtype)
    dq, dk, dv = _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, kx, vx, out, lse, 0.0, causal, attn_mask=fmask, scale=scale
    )
    if not native:
        dk, dv = (t.unflatten(1, (kv, -1)).sum(2) for t in (dk, dv))
    if up:
        dq, dk, dv = dq.to(dtype), dk.to(dtype), dv.to(dtype)
    return dq, dk, dv


class _Fp32Attention(torch.autograd.Function):
    """`attention` under autograd where the dtype computes in fp32: the flash pair above, saving
    q, k, v, the rounded out and lse in their own dtypes (what SDPA's autograd keeps), so the
    backward is attention_bwd's own call on the same tensors."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask, causal):  # type: ignore[no-untyped-def, override]
        out, lse = _flash_fwd(q, k, v, scale, mask, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.mask, ctx.causal = scale, mask, causal
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def, override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _flash_bwd(dout, q, k, v, out, lse, ctx.scale, ctx.mask, ctx.causal)
        return dq, dk, dv, None, None, None


class _CappedAttention(torch.autograd.Function):
    """`attention` under autograd with a logit soft-cap: the query-chunked pair (the only one
    with the cap), saving q, k, v, out and lse, so bp's attention gradients are mesp's call."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask, softcap):  # type: ignore[no-untyped-def, override]
        out, lse = attention_chunked.chunked_fwd(q, k, v, scale, mask, 256, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.mask, ctx.softcap = scale, mask, softcap
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def, override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_chunked.chunked_bwd(
            dout, q, k, v, out, lse, ctx.scale, ctx.mask, 256, ctx.softcap
        )
        return dq, dk, dv, None, None, None
