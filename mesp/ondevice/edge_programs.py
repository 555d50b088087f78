"""The embedding and the loss as pure functions for `torch.export`, beside the block's in
programs.py: every tensor an argument, only the family's constants baked in (EdgeSpec), and the
ops of the in-process path (CausalLM.embed, FrozenWeight.gather, mesp.ops.cross_entropy's dense
and sliced heads) in the same order and dtypes, so an exported step reproduces the engine's bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.ondevice.programs import Tensors, WeightSpec, dense, dequantizer, rows
from mesp.ops.cross_entropy import _capped, _dlogits, _logits
from mesp.ops.norm import rms_norm, rms_norm_backward
from mesp.ops.qmatmul import PackedKernel


@dataclass(frozen=True)
class EdgeSpec:
    """The embedding, final norm and head: storage and the family's constants."""

    embed: WeightSpec
    head: WeightSpec  # == embed when tied
    dtype: torch.dtype
    embed_scale: float | None  # Gemma: × √hidden
    eps: float
    norm_offset: float
    softcap: float | None
    vocab_chunk: int | None  # head slices of this many rows (None: whole head at once)
    vocab: int
    embed_mult: float | None = None  # Granite: × embedding_multiplier, a Python float as HF's
    logits_div: float | None = None  # Granite: the final norm's output ÷ logits_scaling


def embed(es: EdgeSpec, w: Tensors, ids: Tensor) -> Tensor:
    """ids (B, S) -> (B, S, hidden), as CausalLM.embed (FrozenWeight.gather); ids are checked
    by the caller (a data-dependent check cannot be captured)."""
    p = es.embed.prefix
    if es.embed.quant is None:
        h = F.embedding(ids, w[f"{p}.weight"])
    else:
        flat = ids.reshape(-1)
        sel = [w[f"{p}.{k}"].index_select(0, flat) for k in ("weight", "scales", "biases")]
        h = dequantizer(es.embed)(sel[0], sel[1], sel[2], es.embed.quant, None)
        h = h.view(*ids.shape, h.shape[-1])
    h = h.to(es.dtype)
    if es.embed_scale is not None:
        h = h * torch.full((), es.embed_scale, dtype=es.dtype)  # an op, not a lifted constant
    if es.embed_mult is not None:
        h = h * es.embed_mult
    return h


def _whole_head(
    es: EdgeSpec, w: Tensors, hs: Tensor, tgt: Tensor, norm: Tensor
) -> tuple[Tensor, Tensor]:
    """cross_entropy._dense_head for one row chunk holding every trained row; the row losses
    are returned unsummed."""
    ct = torch.promote_types(hs.dtype, torch.float32)
    wd = dense(w, es.head, hs.dtype)
    z, t = _logits(hs, wd, es.softcap, ct)
    lse = torch.logsumexp(z, -1)
    loss = lse - z.gather(1, tgt[:, None]).squeeze(1)
    return loss, _dlogits(z, t, lse, tgt, norm, None).to(wd.dtype) @ wd  # type: ignore[arg-type]


def gather(w: Tensors, ws: WeightSpec, ids: Tensor) -> Tensor:
    """Rows at ids (n,) -> (n, in), as FrozenWeight.gather (ids checked by the caller)."""
    p = ws.prefix
    if ws.quant is None:
        return F.embedding(ids, w[f"{p}.weight"])
    sel = [w[f"{p}.{k}"].index_select(0, ids) for k in ("weight", "scales", "biases")]
    return dequantizer(ws)(sel[0], sel[1], sel[2], ws.quant, None)


HEAD_KEYS = ("weight", "scales", "biases")


def head_slice(w: Tensors, ws: WeightSpec, v0: int, v1: int) -> Tensors:
    """The stored rows v0:v1 of the head (views), keyed as the slice program reads them."""
    keys = HEAD_KEYS if ws.quant is not None else ("weight",)
    return {k: w[f"{ws.prefix}.{k}"][v0:v1] for k in keys}


def loss_start(es: EdgeSpec, w: Tensors, h: Tensor, ids: Tensor) -> Tensors:
    """h (B, S, hidden), ids (n,) trained rows -> hs (n, hidden), the final norm's output at
    those rows, and the online-logsumexp state before the first vocabulary slice: running max
    m, sum s, target logit tz (n,) each, cap'(z_t) ctg (softcap only) and acc (n, hidden), the
    softmax-weighted head rows."""
    hn = rms_norm(h, w["norm.weight"], es.eps, es.norm_offset)
    if es.logits_div is not None:  # RMSNorm's divisor, as the in-process final norm
        hn = hn / es.logits_div
    hs = hn.reshape(-1, hn.shape[-1]).index_select(0, ids)
    ct = torch.promote_types(hs.dtype, torch.float32)
    m = torch.full((hs.shape[0],), -torch.inf, dtype=ct, device=hs.device)
    st = {"hs": hs, "m": m, "s": torch.zeros_like(m), "tz": torch.zeros_like(m)}
    if es.softcap:
        st["ctg"] = torch.ones_like(m)
    st["acc"] = torch.zeros(hs.shape, dtype=ct, device=hs.device)
    return st


def loss_slice(es: EdgeSpec, head: Tensors, st: Tensors, tgt: Tensor, v0: Tensor | int) -> Tensors:
    """One vocabulary slice of cross_entropy._sliced_head, op for op: `head` holds the slice's
    stored rows (width = its row count), starting at vocabulary id v0; st is loss_start's state
    (hs is read, the rest updated). Returns the new state (hs excluded)."""
    hs = st["hs"]
    ct = torch.promote_types(hs.dtype, torch.float32)
    width = head["weight"].shape[0]
    p = es.head.prefix
    if es.head.kernel and es.head.quant is not None:  # the slice stays packed (mesp.ops.qmatmul)
        ws = PackedKernel(head["weight"], head["scales"], head["biases"], es.head.quant)
        z, t = _capped(ws.linear(hs).to(ct), es.softcap)
    else:
        ws = rows({f"{p}.{k}": t for k, t in head.items()}, es.head, 0, width, hs.dtype)
        ws = ws.to(hs.dtype)
        z, t = _logits(hs, ws, es.softcap, ct)
    local = tgt - v0
    hit = (local >= 0) & (local < width)
    col = torch.where(hit, local, 0)[:, None]
    tz = torch.where(hit, z.gather(1, col).squeeze(1), st["tz"])  # before z changes
    m = st["m"]
    m_new = torch.maximum(m, z.amax(-1))
    scale = (m - m_new).exp()
    e = z.sub(m_new[:, None]).exp()
    out = {"m": m_new, "s": st["s"].mul(scale).add(e.sum(-1)), "tz": tz}
    if es.softcap:  # cap'(z) = 1 - tanh²
        c = t.square().neg().add(1.0)
        out["ctg"] = torch.where(hit, c.gather(1, col).squeeze(1), st["ctg"])
        e = e.mul(c)
    eh = e.to(hs.dtype)
    out["acc"] = (
        st["acc"]
        .mul(scale[:, None])
        .add(ws.matmul(eh) if isinstance(ws, PackedKernel) else eh @ ws)
    )
    return out


def loss_finish(
    es: EdgeSpec, w: Tensors, h: Tensor, ids: Tensor, tgt: Tensor, st: Tensors, norm: Tensor
) -> tuple[Tensor, Tensor]:
    """After the last slice: per-row losses lse - z_t (n,) and dh = d(loss_sum / norm)/dh
    (B, S, hidden): (acc/s - cap'(z_t)·W_t) / norm scattered to the trained rows, through the
    final norm's backward. W_t are the target rows, gathered from the whole (mapped) head."""
    ct = torch.promote_types(h.dtype, torch.float32)
    lse = st["m"] + st["s"].log()
    loss = lse - st["tz"]
    wt = gather(w, es.head, tgt).to(ct)
    if es.softcap:
        wt = wt * st["ctg"][:, None]
    dhs = (st["acc"] / st["s"][:, None] - wt) / norm
    h2 = h.reshape(-1, h.shape[-1])
    dhn = torch.zeros_like(h2).index_copy(0, ids, dhs.to(h.dtype)).view(h.shape)
    if es.logits_div is not None:  # mesp_block.norm_bwd's dy ÷ divisor
        dhn = dhn / es.logits_div
    return loss, rms_norm_backward(dhn, h, w["norm.weight"], es.eps, es.norm_offset)


def loss_and_grad(
    es: EdgeSpec, w: Tensors, h: Tensor, ids: Tensor, tgt: Tensor, norm: Tensor
) -> tuple[Tensor, Tensor]:
    """Final norm + head + CE. h (B, S, hidden) last block output; ids (n,) flat indices of the
    trained rows, tgt (n,) their targets; norm: the loss normalizer (0-d, h.dtype).
    -> (per-row losses (n,) in fp32, d(loss_sum / norm)/dh (B, S, hidden)). The caller sums
    the rows in fp64, as cross_entropy does (a graph for edge runtimes carries no fp64 op).
    With vocab_chunk: loss_start, loss_slice per slice, loss_finish, the ExecuTorch drivers'
    loop in one graph."""
    if es.vocab_chunk is not None:
        st = loss_start(es, w, h, ids)
        for v0 in range(0, es.vocab, es.vocab_chunk):
            v1 = min(v0 + es.vocab_chunk, es.vocab)
            st.update(loss_slice(es, head_slice(w, es.head, v0, v1), st, tgt, v0))
        return loss_finish(es, w, h, ids, tgt, st, norm)
    hn = rms_norm(h, w["norm.weight"], es.eps, es.norm_offset)
    if es.logits_div is not None:  # RMSNorm's divisor, as the in-process final norm
        hn = hn / es.logits_div
    h2 = hn.reshape(-1, hn.shape[-1])
    loss, dhs = _whole_head(es, w, h2.index_select(0, ids), tgt, norm)
    dhn = torch.zeros_like(h2).index_copy_(0, ids, dhs).view(h.shape)
    if es.logits_div is not None:  # mesp_block.norm_bwd's dy ÷ divisor
        dhn = dhn / es.logits_div
    return loss, rms_norm_backward(dhn, h, w["norm.weight"], es.eps, es.norm_offset)
