"""Token cross-entropy through the frozen LM head without ever forming (tokens × vocab) logits.

Only trained (mask=True) rows are touched at all: they are gathered first, then processed in row
chunks. With `vocab_chunk` the head is also sliced (dequantized one vocabulary slice at a time):
an online logsumexp pass, then a gradient pass, so neither the whole head nor a (rows × V) block
exists at once: Gemma3's 262k-row head in bf16 alone is ~0.6 GB per 1k hidden units.
Log-softmax runs in fp32 (fp64 for fp64 input); logits come from a matmul in h.dtype, as the
model's own `logits` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mesp.models.linear import FrozenWeight
from mesp.ops.matmul import computes_in_fp32, linear, matmul
from mesp.ops.sampled_softmax import choose_subset, subset_head


def _logits(hc: Tensor, w: Tensor, cap: float | None, ct: torch.dtype) -> tuple[Tensor, Tensor]:
    """hc (c, D), w (v, D) -> z (c, v) in ct, capped z = cap·tanh(z/cap) when cap is set, and
    t = tanh(z/cap) for the derivative (an empty tensor when uncapped)."""
    # fp32 keeps the plain matmul: the exported loss programs trace this op (F.linear there
    # specializes their dynamic row count under a logit softcap)
    return _capped((linear(hc, w) if computes_in_fp32(hc) else hc @ w.t()).to(ct), cap)


def _capped(z: Tensor, cap: float | None) -> tuple[Tensor, Tensor]:
    """_logits' cap on the logits z (in place): (cap·tanh(z/cap), tanh(z/cap)), or (z, empty)."""
    if not cap:
        return z, z.new_empty(0)
    t = z.div_(cap).tanh_()
    return t * cap, t


def _dlogits(
    z: Tensor, t: Tensor, lse: Tensor, tgt: Tensor | None, norm: float, rw: Tensor | None
) -> Tensor:
    """In place on z: (softmax − onehot)/norm, times cap'(z) = 1 − tanh² when capped, times
    the row weight rw (0 for rows that only pay for their logits, see `mask_logits`).
    tgt (c,) holds each row's target column in this slice, or −1 where it lies elsewhere."""
    p = z.sub_(lse[:, None]).exp_()
    if tgt is not None:  # −1 at each row's target column (rows whose target is elsewhere: 0)
        hit = (tgt >= 0).to(p.dtype)[:, None]
        p.scatter_add_(1, tgt.clamp(min=0)[:, None], hit.neg_())
    p.div_(norm)
    if rw is not None:
        p.mul_(rw[:, None])
    return p.mul_(t.square_().neg_().add_(1.0)) if t.numel() else p


def _weighted(x: Tensor, rw: Tensor | None) -> Tensor:
    return x if rw is None else x * rw


def _select(h: Tensor, targets: Tensor, mask: Tensor, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flatten to (N, D); find the trained rows: (h2, row ids (n,), their targets (n,)).
    ids and targets stay where mask and targets live: on a meta-device model (memory
    accounting) the batch stays on the host, and callers move them with `.to(h.device)`."""
    h2 = h.reshape(-1, h.shape[-1])
    ids = mask.reshape(-1).nonzero().squeeze(1)
    tgt = targets.reshape(-1).index_select(0, ids)
    if tgt.numel() and not (0 <= int(tgt.min()) and int(tgt.max()) < vocab):
        raise ValueError(f"trained targets must lie in 0:{vocab}")
    return h2, ids, tgt


def _dense_head(
    hs: Tensor,
    tgt: Tensor,
    w: Tensor,
    cap: float | None,
    rows: int,
    norm: float | None,
    rw: Tensor | None = None,
    bias: Tensor | None = None,
    rows_out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """hs (n, D), w (v, D) dense head rows, tgt (n,) columns of w -> (loss sum, dhs (n, D) or
    None when norm is None). One (rows × v) logits block (and its tanh when capped) at a time.
    bias (v,): constant offsets added to the (capped) logits (the sampled softmax's weights)."""
    ct = torch.promote_types(hs.dtype, torch.float32)
    loss = torch.zeros((), dtype=torch.float64, device=hs.device)  # row losses summed in fp64
    dhs = None if norm is None else torch.empty_like(hs)
    for r0 in range(0, hs.shape[0], rows):
        hc, tc = hs[r0 : r0 + rows], tgt[r0 : r0 + rows]
        rc = None if rw is None else rw[r0 : r0 + rows]
        z, t = _logits(hc, w, cap, ct)
        if bias is not None:
            z += bias
        lse = torch.logsumexp(z, -1)
        row = lse - z.gather(1, tc[:, None]).squeeze(1)
        if rows_out is not None:  # each row's own loss (a preference objective's log-probs)
            rows_out[r0 : r0 + rows] = row
        loss += _weighted(row, rc).sum(dtype=torch.float64)
        if dhs is not None and norm is not None:
            dz = _dlogits(z, t, lse, tc, norm, rc).to(w.dtype)
            dhs[r0 : r0 + rows] = matmul(dz, w)  # (c, v)(v, D)
            del dz
        del z, t, lse
    return loss, dhs


def _sliced_head(
    hs: Tensor,
    tgt: Tensor,
    head: FrozenWeight,
    cap: float | None,
    rows: int,
    vchunk: int,
    norm: float | None,
    rw: Tensor | None = None,
    rows_out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """As _dense_head over the whole head, in vocabulary slices (outer loop: each slice is
    dequantized once) and ONE pass, the way flash attention accumulates its output. With m the
    running row max and s the running sum of e^(z−m):
        s ← s·e^(m−m') + Σ_v e^(z_v−m'),   acc ← acc·e^(m−m') + Σ_v e^(z_v−m')·c_v·W_v
    where c_v = 1 − tanh²(u_v/cap) under a softcap (else 1). At the end lse = m + log s and
        dh = (acc/s − c_target·W_target) / norm = Σ_v (softmax_v − onehot_v)·c_v·W_v / norm,
    so the logits are formed once instead of twice (one logsumexp pass, one gradient pass)."""
    ct = torch.promote_types(hs.dtype, torch.float32)
    n, vocab = hs.shape[0], head.out_features
    grad = norm is not None
    m = torch.full((n,), -torch.inf, dtype=ct, device=hs.device)
    s, tz = torch.zeros_like(m), torch.zeros_like(m)
    ctg = torch.ones_like(m) if grad and cap else None  # cap'(z) at each row's target
    acc = torch.zeros(hs.shape, dtype=ct, device=hs.device) if grad else None
    for v0 in range(0, vocab, vchunk):
        v1 = min(v0 + vchunk, vocab)
        w = head.rows(v0, v1, hs.dtype).to(hs.dtype)
        local = torch.where((tgt >= v0) & (tgt < v1), tgt - v0, -1)
        for r0 in range(0, n, rows):
            r = slice(r0, r0 + rows)
            z, t = _logits(hs[r], w, cap, ct)
            mc, sc, lc = m[r], s[r], local[r]
            hit, col = lc >= 0, lc.clamp(min=0)[:, None]
            tz[r] = torch.where(hit, z.gather(1, col).squeeze(1), tz[r])  # before z changes
            m_new = torch.maximum(mc, z.amax(-1))
            scale = (mc - m_new).exp_()
            e = z.sub_(m_new[:, None]).exp_()  # (c, v), in place of z
            sc.mul_(scale).add_(e.sum(-1))
            if acc is not None:
                if ctg is not None:  # cap'(z) = 1 − tanh²
                    c = t.square_().neg_().add_(1.0)
                    ctg[r] = torch.where(hit, c.gather(1, col).squeeze(1), ctg[r])
                    e.mul_(c)
                acc[r].mul_(scale[:, None]).add_(matmul(e.to(w.dtype), w))  # (c, v)(v, D)
            mc.copy_(m_new)
            del z, t, e  # free this chunk's logits before the next is formed
        del w  # and this slice before the next is dequantized
    lse = m + s.log()  # (s is still needed below)
    if rows_out is not None:
        rows_out.copy_(lse - tz)
    loss = _weighted(lse - tz, rw).sum(dtype=torch.float64)
    if acc is None or norm is None:
        return loss, None
    for r0 in range(0, n, rows):  # acc/s − c_t·W_t, row chunk by row chunk
        r = slice(r0, r0 + rows)
        wt = head.gather(tgt[r]).to(ct)
        if ctg is not None:
            wt.mul_(ctg[r, None])
        a = acc[r].div_(s[r, None]).sub_(wt)
        a.div_(norm)
        if rw is not None:
            a.mul_(rw[r, None])
        del wt
    return loss, acc.to(hs.dtype)


@dataclass(frozen=True)
class CEOptions:
    """How the loss head runs. `chunk_rows` None: all rows in one block (the full-logits
    baseline); `vocab_chunk` None: the head in one piece. `mask_logits` False still trains only
    mask=True rows but forms logits for every row (the cost logits masking removes).
    `vocab_subset` K: softmax over targets + K proxy-chosen tokens (see sampled_softmax)."""

    chunk_rows: int | None = 1024
    vocab_chunk: int | None = None
    mask_logits: bool = True
    vocab_subset: int | None = None
    seed: int = 0


def _run(
    h: Tensor,
    targets: Tensor,
    mask: Tensor,
    head: FrozenWeight,
    softcap: float | None,
    opts: CEOptions,
    normalizer: float | None,
    grad: bool,
    weights: Tensor | None = None,
    rows_out: Tensor | None = None,
) -> tuple[Tensor, int, Tensor | None]:
    vocab = head.out_features
    h2, ids, tgt = _select(h, targets, mask, vocab)
    # the host copies go at once (a meta-device model's peak counts what a CPU run holds),
    # but the sampled softmax reads the targets on the host
    tgt_host = tgt if opts.vocab_subset is not None else None
    ids, tgt = ids.to(h.device), tgt.to(h.device)
    n = ids.numel()
    ct = torch.promote_types(h.dtype, torch.float32)
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64, device=h.device)
        return zero, 0, torch.zeros_like(h) if grad else None
    norm = None
    if grad:
        norm = float(n if normalizer is None else normalizer)
        if norm <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
    rw = None
    if opts.mask_logits:
        hs = h2.index_select(0, ids)  # (n, D): trained rows only
    else:  # every row forms logits; untrained rows weigh 0 (target 0 is a placeholder)
        hs, rw = h2, mask.reshape(-1).to(device=h.device, dtype=ct)
        tgt = torch.zeros(h2.shape[0], dtype=tgt.dtype, device=h.device).index_copy_(0, ids, tgt)
    if weights is not None:  # per-token loss weights (a preference objective's, see engines)
        w = weights.reshape(-1).to(device=h.device, dtype=ct)
        rw = w.index_select(0, ids) if rw is None else rw * w
    per = None if rows_out is None else hs.new_zeros(hs.shape[0], dtype=ct)
    rows = opts.chunk_rows or hs.shape[0]
    vchunk = opts.vocab_chunk if opts.vocab_chunk and opts.vocab_chunk < vocab else None
    if opts.vocab_subset is not None:
        trained = hs if rw is None else h2.index_select(0, ids)
        assert tgt_host is not None
        subset, bias = choose_subset(
            trained, tgt_host, head, opts.vocab_subset, opts.seed, vchunk or vocab
        )
        del trained
        w, local = subset_head(head, subset, tgt, hs.dtype)
        loss, dhs = _dense_head(hs, local, w, softcap, rows, norm, rw, bias.to(ct), per)
        del w
    elif vchunk is None:
        loss, dhs = _dense_head(hs, tgt, head.dense(hs.dtype), softcap, rows, norm, rw, None, per)
    else:
        loss, dhs = _sliced_head(hs, tgt, head, softcap, rows, vchunk, norm, rw, per)
    if per is not None and rows_out is not None:  # back to (N,) positions, 0 where untrained
        if opts.mask_logits:
            rows_out.index_copy_(0, ids, per)
        else:  # untrained rows scored their placeholder target: zero them
            rows_out.copy_(per * mask.reshape(-1).to(per))
    if dhs is None:
        return loss, n, None
    if not opts.mask_logits:  # every row has its dh already
        return loss, n, dhs.view(h.shape)
    dh = torch.zeros_like(h2).index_copy_(0, ids, dhs)  # zero at untrained rows
    return loss, n, dh.view(h.shape)


def chunked_ce_loss_and_grad(
    h: Tensor,
    targets: Tensor,
    mask: Tensor,
    head: FrozenWeight,
    softcap: float | None,
    chunk_rows: int | None = 1024,
    vocab_chunk: int | None = None,
    normalizer: float | None = None,
    opts: CEOptions | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, int, Tensor]:
    """h (N, D) (or (B, S, D)) final-normed states, targets/mask (N,) -> (summed loss over
    trained rows, as a 0-d fp64 tensor (row losses in fp32, or fp64 for fp64 h); their
    count n; dh like h).
    dh is the gradient of loss_sum / normalizer (default n, i.e. of the mean loss):
    with p = softmax(z), ∂loss/∂z = p − onehot(target); z = cap·tanh(u/cap) adds the factor
    1 − tanh²(u/cap); u = h Wᵀ gives dh = du W. Rows with mask False get zeros.
    `opts`, when given, replaces chunk_rows / vocab_chunk. `weights` (like targets): each
    token's loss counts that many times, in the sum and in dh."""
    o = opts or CEOptions(chunk_rows, vocab_chunk)
    loss, n, dh = _run(h, targets, mask, head, softcap, o, normalizer, True, weights)
    assert dh is not None
    return loss, n, dh


def chunked_ce_loss(
    h: Tensor,
    targets: Tensor,
    mask: Tensor,
    head: FrozenWeight,
    softcap: float | None,
    chunk_rows: int | None = 1024,
    vocab_chunk: int | None = None,
    opts: CEOptions | None = None,
) -> tuple[Tensor, int]:
    """Forward only (evaluation): (summed loss over trained rows, their count)."""
    o = opts or CEOptions(chunk_rows, vocab_chunk)
    loss, n, _ = _run(h, targets, mask, head, softcap, o, None, grad=False)
    return loss, n


def chunked_ce_row_losses(
    h: Tensor,
    targets: Tensor,
    mask: Tensor,
    head: FrozenWeight,
    softcap: float | None,
    opts: CEOptions,
) -> Tensor:
    """Forward only: each position's token loss (N,) (fp32; 0 where mask is False), in one
    pass over the head: a preference objective sums them per sequence."""
    rows = torch.zeros(mask.numel(), dtype=torch.promote_types(h.dtype, torch.float32))
    rows = rows.to(h.device)
    _run(h, targets, mask, head, softcap, opts, None, False, None, rows)
    return rows
