"""Exact query-chunked attention, forward and backward: the fallback of mesp.ops.attention where
the CPU flash kernels do not run (CUDA, MPS, a torch without them). At most (B, H, chunk, keys)
scores exist at a time; math in fp32 or wider.

Gemma 2's attention logit soft-capping (`softcap`) lives here only (the flash kernels have no
cap): the scores become cap·tanh(s/cap) before the mask, and the backward multiplies the score
gradient by ∂/∂s = 1 − tanh²(s/cap) = 1 − (capped/cap)²."""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_scores(
    qc: Tensor,
    k: Tensor,
    scale: float,
    mask: Tensor | None,
    i0: int,
    i1: int,
    softcap: float | None = None,
) -> tuple[Tensor, int, int]:
    """Scaled (and capped: cap·tanh(s/cap)), masked scores of queries i0:i1 against the keys
    they can reach, lo:hi. qc (B, KV, g, c, D), k (B, KV, T, D) -> s (B, KV, g, c, hi − lo),
    plus lo, hi."""
    n_keys = k.shape[2]
    if mask is None:  # causal, top-left aligned: query i sees keys 0 … i
        lo, hi = 0, min(i1, n_keys)
        allow = torch.arange(i0, i1, device=k.device)[:, None] >= torch.arange(hi, device=k.device)
    elif mask.dtype == torch.bool:  # only the key span any query in the chunk can see
        allow = mask[i0:i1]
        cols = allow.any(0).nonzero()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 1)
        allow = allow[:, lo:hi]
    else:
        lo, hi, allow = 0, n_keys, None
    s = torch.matmul(qc, k[:, :, lo:hi].unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if softcap:  # as HF: s / cap, tanh, × cap, then the mask
        s.div_(softcap).tanh_().mul_(softcap)
    if allow is None:
        s.add_(mask[i0:i1].to(s.dtype))  # type: ignore[index]
    else:
        s.masked_fill_(~allow, -torch.inf)
    return s, lo, hi


def chunked_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: Tensor | None,
    chunk: int,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per query chunk: s = q kᵀ·scale, lse = logsumexp(s), out = softmax(s) v (exact; every
    query row's softmax sees all its keys at once, so no online rescaling is needed)."""
    ct, (b, h, n, _), kv = _compute_dtype(q.dtype), q.shape, k.shape[1]
    qg, kc, vc = q.to(ct).unflatten(1, (kv, h // kv)), k.to(ct), v.to(ct)
    out = torch.empty(b, kv, h // kv, n, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, kv, h // kv, n, dtype=ct, device=q.device)
    for i0 in range(0, n, chunk):
        i1 = min(i0 + chunk, n)
        s, lo, hi = _chunk_scores(qg[:, :, :, i0:i1], kc, scale, mask, i0, i1, softcap)
        m = torch.logsumexp(s, -1)
        lse[..., i0:i1] = m
        out[..., i0:i1, :] = torch.matmul(s.sub_(m.unsqueeze(-1)).exp_(), vc[:, :, None, lo:hi])
    return out.view(b, h, n, -1), lse.view(b, h, n)


def chunked_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    mask: Tensor | None,
    chunk: int,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """With p = exp(s − lse) recomputed per chunk and δ = rowsum(dout ∘ out):
    dv += pᵀ dout, dp = dout vᵀ, ds = p ∘ (dp − δ), dq = ds k·scale, dk += dsᵀ q·scale.
    Under a softcap, s = cap·tanh(r/cap) of the raw scaled score r, so ds is first multiplied by
    ds/dr = 1 − (s/cap)² (masked entries: p = 0, factor clamped to 0 so no inf·0 appears).
    Folding the group axis g into the query rows makes pᵀ dout / dsᵀ q sum over the group."""
    ct, (b, h, n, d), kv = _compute_dtype(q.dtype), q.shape, k.shape[1]
    g = h // kv
    qg, kc, vc = q.to(ct).unflatten(1, (kv, g)), k.to(ct), v.to(ct)
    dog = dout.to(ct).unflatten(1, (kv, g))
    delta = (dog * out.to(ct).unflatten(1, (kv, g))).sum(-1)  # (B, KV, g, S)
    lse_g = lse.to(ct).unflatten(1, (kv, g))
    dq = torch.empty(b, kv, g, n, d, dtype=q.dtype, device=q.device)
    dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
    for i0 in range(0, n, chunk):
        i1 = min(i0 + chunk, n)
        qc, doc = qg[:, :, :, i0:i1], dog[:, :, :, i0:i1]
        s, lo, hi = _chunk_scores(qc, kc, scale, mask, i0, i1, softcap)
        dcap = None if not softcap else (1 - (s / softcap).square()).clamp_min_(0)
        p = s.sub_(lse_g[..., i0:i1, None]).exp_()  # (B, KV, g, c, t)
        dv[:, :, lo:hi] += p.flatten(2, 3).transpose(-1, -2) @ doc.flatten(2, 3)
        ds = torch.matmul(doc, vc[:, :, None, lo:hi].transpose(-1, -2))
        ds.sub_(delta[..., i0:i1, None]).mul_(p).mul_(scale)
        if dcap is not None:  # through cap·tanh(r/cap)
            ds.mul_(dcap)
        dq[:, :, :, i0:i1] = torch.matmul(ds, kc[:, :, None, lo:hi])
        dk[:, :, lo:hi] += ds.flatten(2, 3).transpose(-1, -2) @ qc.flatten(2, 3)
    return dq.view(b, h, n, d), dk.to(k.dtype), dv.to(v.dtype)
