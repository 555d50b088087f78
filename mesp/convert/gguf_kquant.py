"""llama.cpp's k-quant block quantizers Q4_K, Q5_K and Q6_K (the reference path llama-quantize
takes without an importance matrix), vectorized over every block of a tensor.

A super-block is 256 weights of one row. The bytes are ggml's block layouts (what gguf-py's
`dequantize` reads):
- Q4_K (144 B): f16 d, f16 dmin, 12 B of eight 6-bit (scale, min) pairs, 128 B of 4-bit codes;
  weight = d*sc_j*q - dmin*m_j over eight sub-blocks of 32.
- Q5_K (176 B): as Q4_K plus 32 B holding each code's fifth bit.
- Q6_K (210 B): 128 B low nibbles, 64 B high two bits, sixteen int8 scales, f16 d;
  weight = d*sc_j*(q - 32) over sixteen sub-blocks of 16.

How a block is chosen (the algorithm of ggml-quants.c's make_qkx2_quants / make_qx_quants):
- Q4_K/Q5_K: per sub-block, an affine fit min + scale*L, L in 0..nmax, weighted by
  rms(sub-block) + |x|. The first guess spans [min(x, 0), max(x)]; then nstep+1 grid scales
  (nmax + rmin + rdelta*i)/(max - min) are tried in turn, each rounding x with the best min so
  far and refitting scale and min by weighted least squares (min clamped to <= 0); a fit is
  kept when its weighted squared error is lower. The eight scales and eight mins are then coded
  as 6-bit multiples of d = max scale/63 and dmin = max min/63, and x is rounded again
  against the coded values.
- Q6_K: per sub-block of 16, a symmetric fit L in -32..31 weighted by x^2: the scale that maps
  the largest |x| to -32, then 18 nearby ones (-(32 + 0.1 i)/max), the one maximizing
  (sum w x l)^2 / sum w l^2 kept (the first on a tie). The sixteen scales are coded as int8
  multiples of d = max scale / -128, and x is rounded again.
Rounding is to nearest, ties to even, as ggml's nearest_int. Every float32 operation, sums
included, runs in the C code's order (sums one term at a time), so the bytes equal those of
ggml's quantize_row_q{4,5,6}_K_ref compiled without FMA contraction (tests/test_gguf_kquant.py
holds known answers); a llama.cpp build that contracts a*b+c into FMA can differ where two
candidate fits tie to the last bit.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

QK_K = 256
ROWS_PER_CHUNK = 4096  # super-blocks per pass: bounds the working set (~40 MB) on any tensor
EPS = 1e-15  # ggml's GROUP_MAX_EPS: a sub-block this small is all zero


def _f32_step(rmin: float, rdelta: float, i: int, nmax: int) -> np.float32:
    """A candidate's rmin + rdelta*i + nmax in float32, in C's order: where it is a half
    integer the largest weight lands exactly on a rounding tie, so its last bit decides a code."""
    f = np.float32
    return f(f(f(rmin) + f(rdelta) * f(i)) + f(nmax))


def _seq(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0 one term at a time in float32, as the C loops add (and so with the
    same rounding): a (k, n) array -> (n,)."""
    total = a[0].copy()
    for row in a[1:]:
        total += row
    return total


def _affine_fit(
    x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-blocks x (n, 32) -> (scale, -min, codes) of the best affine fit (module docstring).
    Worked on as xt (32, n): per-sub-block values broadcast along the last axis, and each sum
    runs over the 32 weights in order."""
    f = np.float32
    xt = np.ascontiguousarray(x.T, dtype=f)
    w = np.sqrt(_seq(xt * xt) / f(len(xt))) + np.abs(xt)
    sum_w = _seq(w)
    sum_x = _seq(w * xt)
    lo = np.minimum(xt.min(0), f(0))
    hi = xt.max(0)
    flat = hi == lo
    span = np.where(flat, f(1), hi - lo)
    # the candidate that wins is remembered by how it rounds (iscale, min), not by its codes
    iscale = f(nmax) / span
    code_min = lo.copy()
    scale = f(1) / iscale
    mn = lo.copy()
    q = np.clip(np.rint(iscale * (xt - mn)), 0, nmax)
    best = _seq(w * np.square(scale * q + mn - xt))
    for i in range(nstep + 1):
        width = hi - mn
        isc = _f32_step(rmin, rdelta, i, nmax) / np.where(width == 0, f(1), width)
        la = np.clip(np.rint(isc * (xt - mn)), 0, nmax)
        wl = w * la
        sl, sl2, sxl = _seq(wl), _seq(wl * la), _seq(wl * xt)
        det = sum_w * sl2 - sl * sl
        ok = det > 0
        det = np.where(ok, det, f(1))
        s = (sum_w * sxl - sum_x * sl) / det
        m = (sl2 * sum_x - sl * sxl) / det
        pos = m > 0  # a positive min is not representable: refit the scale through 0
        s = np.where(pos, sxl / np.where(sl2 > 0, sl2, f(1)), s)
        m = np.where(pos, f(0), m)
        err = _seq(w * np.square(s * la + m - xt))
        win = ok & (err < best) & ~flat
        iscale = np.where(win, isc, iscale)
        code_min = np.where(win, mn, code_min)
        scale = np.where(win, s, scale)
        best = np.where(win, err, best)
        mn = np.where(win, m, mn)
    codes = np.clip(np.rint(iscale * (xt - code_min)), 0, nmax).T
    scale = np.where(flat, f(0), scale)
    codes[flat] = 0
    return scale, -mn, codes.astype(np.uint8)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _pack_scale_min(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block (n, 8) -> ggml's 12-byte K_SCALE layout."""
    out = np.empty((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _qk_affine(x: np.ndarray, bits: int) -> np.ndarray:
    """Super-blocks x (n, 256) -> Q4_K (bits 4) or Q5_K (bits 5) blocks (n, 144 | 176)."""
    n = x.shape[0]
    nmax = (1 << bits) - 1
    rmin, nstep = (-1.0, 20) if bits == 4 else (-0.5, 15)
    sub = x.reshape(n * 8, 32)
    scale, negmin, codes = _affine_fit(sub, nmax, rmin, 0.1, nstep)
    scale, negmin = scale.reshape(n, 8), negmin.reshape(n, 8)
    max_scale = np.maximum(scale.max(1), 0)
    max_min = np.maximum(negmin.max(1), 0)
    inv_s = np.where(max_scale > 0, np.float32(63) / np.where(max_scale > 0, max_scale, 1), 0)
    inv_m = np.where(max_min > 0, np.float32(63) / np.where(max_min > 0, max_min, 1), 0)
    ls = np.minimum(np.rint(inv_s[:, None] * scale), 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_m[:, None] * negmin), 63).astype(np.uint8)
    d = _f16(max_scale / np.float32(63))
    dmin = _f16(max_min / np.float32(63))
    dj = d.astype(np.float32)[:, None] * ls  # the coded scale and min of each sub-block
    mj = dmin.astype(np.float32)[:, None] * lm
    live = dj != 0  # a zero scale keeps the fit's codes: they decode to -min either way
    xs = x.reshape(n, 8, 32)
    requant = np.rint((xs + mj[..., None]) / np.where(live, dj, 1)[..., None])
    q = np.where(live[..., None], np.clip(requant, 0, nmax), codes.reshape(n, 8, 32))
    q = q.astype(np.uint8).reshape(n, 4, 2, 32)  # 64-weight chunks, each two sub-blocks
    head = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2)]
    head.append(_pack_scale_min(ls, lm))
    low = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    if bits == 4:
        return np.concatenate([*head, low], axis=1)
    # fifth bits: bit 2c of byte j for weight j of chunk c, bit 2c+1 for weight 32 + j
    hi_bits = (q >> 4).astype(np.uint8)  # (n, 4, 2, 32)
    shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    qh = np.bitwise_or.reduce(hi_bits << shift[None, :, :, None], axis=(1, 2)).astype(np.uint8)
    return np.concatenate([*head, qh, low], axis=1)


def _symmetric_scales(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sub-blocks x (n, 16) -> (scale, codes 0..63) of make_qx_quants(nmax 32, weights x^2),
    worked on as (16, n) like _affine_fit."""
    f = np.float32
    nmax = 32
    xt = np.ascontiguousarray(x.T, dtype=f)
    idx = np.argmax(np.abs(xt), axis=0)  # the first largest |x|, as the C loop's strict >
    peak = np.take_along_axis(xt, idx[None], axis=0)[0]
    zero = np.abs(peak) < EPS
    peak = np.where(zero, f(1), peak)
    w = xt * xt
    wx = w * xt

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lv = np.clip(np.rint(iscale * xt), -nmax, nmax - 1)
        return _seq(wx * lv), _seq(w * lv * lv)

    iscale = f(-nmax) / peak
    sumlx, suml2 = fit(iscale)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f(1)), f(0))
    best = scale * sumlx
    for i in (*range(-9, 0), *range(1, 10)):
        isc = -_f32_step(0.0, 0.1, i, nmax) / peak
        slx, sl2 = fit(isc)
        win = (sl2 > 0) & (slx * slx > best * sl2)
        iscale = np.where(win, isc, iscale)
        scale = np.where(win, slx / np.where(sl2 > 0, sl2, f(1)), scale)
        best = np.where(win, scale * slx, best)
    codes = (np.clip(np.rint(iscale * xt), -nmax, nmax - 1) + nmax).T
    scale[zero] = 0
    codes[zero] = 0
    return scale, codes.astype(np.uint8)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Super-blocks x (n, 256) -> Q6_K blocks (n, 210)."""
    n = x.shape[0]
    scale, codes = _symmetric_scales(x.reshape(n * 16, 16))
    scale = scale.reshape(n, 16)
    idx = np.argmax(np.abs(scale), axis=1)
    peak = np.take_along_axis(scale, idx[:, None], axis=1)[:, 0]
    empty = np.abs(peak) < EPS  # the whole block is zero bytes
    iscale = np.float32(-128) / np.where(empty, np.float32(1), peak)
    d = _f16(np.where(empty, np.float32(0), np.float32(1) / iscale))
    sc = np.minimum(np.rint(iscale[:, None] * scale), 127).astype(np.int8)
    sc[empty] = 0
    dj = d.astype(np.float32)[:, None] * sc
    live = dj != 0
    xs = x.reshape(n, 16, 16)
    requant = np.clip(np.rint(xs / np.where(live, dj, 1)[..., None]), -32, 31) + 32
    q = np.where(live[..., None], requant, codes.reshape(n, 16, 16)).astype(np.uint8)
    q[empty] = 0
    q = q.reshape(n, 2, 4, 32)  # halves of 128, quarters of 32
    ql = np.concatenate(
        [
            (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
            (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4),
        ],
        axis=2,
    ).reshape(n, 128)
    shift = (2 * np.arange(4)).astype(np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce((q >> 4) << shift, axis=2).astype(np.uint8).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)


KQUANTS = {QT.Q4_K: lambda b: _qk_affine(b, 4), QT.Q5_K: lambda b: _qk_affine(b, 5), QT.Q6_K: _q6_k}


def quantize_k(w: np.ndarray, qtype: QT) -> np.ndarray:
    """A float tensor whose last dimension is a multiple of 256 -> its `qtype` bytes, shaped
    as gguf-py's quantizers shape theirs (rows, bytes per row)."""
    if w.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K}, got {w.shape[-1]}")
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK_K)
    out = np.concatenate(
        [
            KQUANTS[qtype](blocks[i : i + ROWS_PER_CHUNK])
            for i in range(0, len(blocks), ROWS_PER_CHUNK)
        ]
        or [np.empty((0, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)]
    )
    return out.reshape(*w.shape[:-1], w.shape[-1] // QK_K * gguf.GGML_QUANT_SIZES[qtype][1])
