"""bf16 / fp16 matmuls that run at fp32 speed on CPUs without a low-precision GEMM.

Without AVX512-BF16 / AMX, torch's bf16 CPU GEMM is a fallback 5-160x slower than fp32 (about
1 GFLOP/s against 128 on a Zen 3 core pair). There every matmul of the product goes through the
helpers here: the operands are upcast, multiplied in fp32, and the result is rounded once to the
stored dtype. That is what a native bf16 GEMM computes (bf16 in, fp32 accumulation, one rounding
out), so tensors stay bf16 and only the kernel changes. Where the CPU has a native kernel (or on
CUDA, or in fp32 / fp64) the helpers are the plain torch call.

The fp32 copies are transient and bounded: a large operand (an LM head, a logits block) is
upcast one block of at most `BLOCK_BYTES` at a time, so the upcast never holds a whole head.

`MESP_BF16_MATMUL=auto|native|fp32` (default auto: fp32 where the CPU lacks the kernel) forces
either path, for tests and benchmarks.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.errors import MespError

ENV = "MESP_BF16_MATMUL"
MODES = ("auto", "native", "fp32")
LOW = (torch.bfloat16, torch.float16)
BLOCK_BYTES = 4 << 20  # fp32 bytes of upcast operand blocks at a time (GEMMs stay large)


@functools.cache
def native_kernel(dtype: torch.dtype) -> bool:
    """Whether this CPU has a native GEMM for dtype (oneDNN's own check; probed once)."""
    if dtype == torch.float16 and hasattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported"):
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def mode() -> str:
    m = os.environ.get(ENV, "auto") or "auto"
    if m not in MODES:
        raise MespError(f"{ENV} must be one of {', '.join(MODES)}, got {m!r}")
    return m


def computes_in_fp32(t: Tensor) -> bool:
    """Whether matmuls on t (bf16 / fp16 on the CPU, or on the meta device standing for it)
    run as fp32 GEMMs with one rounding. Read per call, so the env override takes effect."""
    if t.dtype not in LOW or t.device.type not in ("cpu", "meta"):
        return False
    m = mode()
    return m == "fp32" or (m == "auto" and not native_kernel(t.dtype))


def _fp32_mm(a: Tensor, b: Tensor, c: Tensor | None, alpha: float, out: Tensor) -> Tensor:
    """out (n, m) = round(c + alpha·a b) with a (n, k), b (k, m) in a low dtype, computed in
    fp32; c: None, a bias (m,), or out itself (an in-place addmm). A wide output is formed in
    column blocks (each rounded as it is written), a long reduction in k blocks summed into an
    fp32 accumulator: either way about BLOCK_BYTES of fp32 copies at a time, beyond a."""
    n, k = a.shape
    m = b.shape[1]
    if 4 * (n * k + k * m + n * m) <= BLOCK_BYTES:  # one block
        if c is None:
            r = torch.mm(a.float(), b.float())
            return out.copy_(r if alpha == 1.0 else r.mul_(alpha))
        return out.copy_(torch.addmm(c.float(), a.float(), b.float(), alpha=alpha))
    if m >= k:  # wide: column blocks of b and out
        step = max(64, BLOCK_BYTES // (4 * (k + n)))
        a32 = a.float()
        for j in range(0, m, step):
            sl = slice(j, j + step)
            bj = b[:, sl].float()
            if c is None:
                r = torch.mm(a32, bj)
                out[:, sl] = r if alpha == 1.0 else r.mul_(alpha)
            else:
                out[:, sl] = torch.addmm(c[..., sl].float(), a32, bj, alpha=alpha)
            del bj
        return out
    step = max(64, BLOCK_BYTES // (4 * (n + m)))  # long reduction: k blocks
    if c is None:
        acc = torch.zeros(n, m, dtype=torch.float32, device=a.device)
    else:
        acc = c.float().expand(n, m).clone(memory_format=torch.contiguous_format)
    for i in range(0, k, step):
        sl = slice(i, i + step)
        acc.addmm_(a[:, sl].float(), b[sl].float(), alpha=alpha)
    return out.copy_(acc)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (..., k) @ b (k, m) -> (..., m): `a @ b` for a 2-D b."""
    if not computes_in_fp32(a) or b.dtype != a.dtype:
        return a @ b
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _Fp32Linear.apply(a, b.t(), None)
    a2 = a.reshape(-1, a.shape[-1])
    out = torch.empty(a2.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return _fp32_mm(a2, b, None, 1.0, out).view(*a.shape[:-1], b.shape[1])


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear: x (..., in), w (out, in), bias (out,) | None -> (..., out), one rounding."""
    if not computes_in_fp32(x) or w.dtype != x.dtype:
        return F.linear(x, w, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias)):
        return _Fp32Linear.apply(x, w, bias)
    return _linear(x, w, bias)


def _linear(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return _fp32_mm(x2, w.t(), bias, 1.0, out).view(*x.shape[:-1], w.shape[0])


def addmm_(acc: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """acc.addmm_(a, b, alpha=alpha) in place: acc (n, m) += alpha · a (n, k) @ b (k, m)."""
    if not computes_in_fp32(acc) or not a.dtype == b.dtype == acc.dtype:
        return acc.addmm_(a, b, alpha=alpha)
    return _fp32_mm(a, b, acc, alpha, acc)


def add_product(y: Tensor, a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """y + alpha · a @ b, y (..., m), a (..., k), b (k, m): one GEMM that adds into its output
    (no (…, m) product or scaled copy, each another pass). y must be a fresh result only the
    caller holds: with no gradient recorded it is updated in place; under autograd the result
    is torch.addmm's (the same bits), so a recorded forward equals an unrecorded one. Leading
    dimensions are flattened for the GEMM and restored on the result."""
    y2, a2 = y.reshape(-1, y.shape[-1]), a.reshape(-1, a.shape[-1])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (y, a, b))
    if not computes_in_fp32(y) or not a.dtype == b.dtype == y.dtype:
        r = torch.addmm(y2, a2, b, alpha=alpha) if grad else y2.addmm_(a2, b, alpha=alpha)
    elif grad:
        r = _Fp32Addmm.apply(y2, a2, b, alpha)
    else:
        r = _fp32_mm(a2, b, y2, alpha, y2)
    return r.view(y.shape)


class _Fp32Addmm(torch.autograd.Function):
    """add_product through the fp32 GEMM under autograd, with addmm's backward:
    dy → dc = dy, da = alpha·(dy bᵀ), db = alpha·(aᵀ dy), each product rounded once."""

    @staticmethod
    def forward(ctx: Any, c: Tensor, a: Tensor, b: Tensor, alpha: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.alpha = alpha
        return _fp32_mm(a, b, c, alpha, torch.empty_like(c))

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        da = matmul(dy, b.t()).mul_(ctx.alpha) if need[1] else None
        db = matmul(a.t(), dy).mul_(ctx.alpha) if need[2] else None
        return (dy if need[0] else None), da, db, None


class _Fp32Linear(torch.autograd.Function):
    """y = x wᵀ + b through the fp32 GEMM, under autograd. Saves x and w in their own dtype
    (as F.linear's autograd does), so training memory is unchanged; backward upcasts again:
    dx = dy w, dw = dyᵀ x (tokens flattened), db = Σ dy, each rounded once."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return _linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if need[0]:
            dx = matmul(dy2, w).view(x.shape)
        if need[1]:
            dw = matmul(dy2.t(), x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and need[2]:
            db = dy2.float().sum(0).to(dy.dtype)
        return dx, dw, db


# A frozen (out, in) weight handed over in blocks: fill(rows, cols, buf) writes W[rows, cols], as
# fp32, into the contiguous buf. A quantized base dequantizes each block straight into fp32 this
# way, and each block is multiplied while it is still in cache: the whole dequantized weight
# never exists, so it is neither written to memory nor read back (and for bf16 there is no
# low-precision copy to upcast). Blocks cut W along its longer side, so every GEMM keeps the
# shorter side whole (a thin block would starve the GEMM).
BlockFill = Callable[[slice, slice, Tensor], object]
WEIGHT_BLOCK_BYTES = 1 << 20  # fp32 bytes of one weight block: a slice of cache, not of DRAM


def _rows_cut(shape: tuple[int, int]) -> bool:
    """Whether W (out, in) is cut into rows (its longer side), else into column groups."""
    return shape[0] >= shape[1]


def weight_spans(
    shape: tuple[int, int],
    align: int,
    block_bytes: int = WEIGHT_BLOCK_BYTES,
    rows_cut: bool | None = None,
) -> tuple[bool, list[slice]]:
    """How W (out, in) = shape is cut: (rows_cut, spans), spans of rows when W is cut into rows
    (by default where out ≥ in), else of columns in whole groups of `align`; each block at most
    block_bytes of fp32 (or one row / one group where that is more)."""
    out_f, in_f = shape
    rows_cut = _rows_cut(shape) if rows_cut is None else rows_cut
    n, width, step_align = (out_f, in_f, 1) if rows_cut else (in_f, out_f, align)
    step = max(step_align, block_bytes // (4 * width) // step_align * step_align)
    return rows_cut, [slice(a, min(n, a + step)) for a in range(0, n, step)]


def _blocks(
    fill: BlockFill, shape: tuple[int, int], align: int, device: torch.device
) -> Iterator[tuple[bool, slice, Tensor]]:
    """W (out, in) = shape as filled fp32 blocks, one reused buffer: (rows_cut, span, block),
    the block W[span, :] when W is cut into rows (out ≥ in), else W[:, span] (whole groups)."""
    out_f, in_f = shape
    rows_cut, spans = weight_spans(shape, align)
    width = in_f if rows_cut else out_f
    buf = torch.empty(max(sp.stop - sp.start for sp in spans) * width, device=device)
    every = slice(0, None)
    for sp in spans:
        k = sp.stop - sp.start
        w = buf[: k * width].view((k, in_f) if rows_cut else (out_f, k))
        if rows_cut:
            fill(sp, every, w)
        else:
            fill(every, sp, w)
        yield rows_cut, sp, w


def linear_blocks(
    x: Tensor, fill: BlockFill, shape: tuple[int, int], align: int, bias: Tensor | None = None
) -> Tensor:
    """F.linear(x, W, bias) for W (out, in) = shape given in blocks; x (..., in) fp32, or a low
    dtype on the fp32 GEMM (one rounding at the end)."""
    out_f, in_f = shape
    x32 = x.reshape(-1, in_f).float()
    y = torch.empty(x32.shape[0], out_f, dtype=x.dtype, device=x.device)
    fp32 = x.dtype == torch.float32
    b32 = None if bias is None else bias.float()
    # the fp32 sum over reduction blocks, rounded at the end (y itself in fp32)
    acc = y if fp32 or _rows_cut(shape) else torch.empty(y.shape, device=x.device)
    for rows_cut, sp, w in _blocks(fill, shape, align, x.device):
        if rows_cut:  # output columns sp, whole reduction: each block rounded as it lands
            r = y[:, sp] if fp32 else torch.empty(y.shape[0], w.shape[0], device=x.device)
            if b32 is None:
                torch.mm(x32, w.t(), out=r)
            else:
                torch.addmm(b32[sp], x32, w.t(), out=r)
            if not fp32:
                y[:, sp] = r
        elif sp.start == 0:  # reduction span sp, summed into every output column
            if b32 is None:
                torch.mm(x32[:, sp], w.t(), out=acc)
            else:
                torch.addmm(b32, x32[:, sp], w.t(), out=acc)
        else:
            acc.addmm_(x32[:, sp], w.t())
    if acc is not y:
        y.copy_(acc)
    return y.view(*x.shape[:-1], out_f)


def matmul_blocks(dy: Tensor, fill: BlockFill, shape: tuple[int, int], align: int) -> Tensor:
    """dy (..., out) @ W for W (out, in) = shape given in blocks; dy fp32, or a low dtype on
    the fp32 GEMM (one rounding at the end)."""
    out_f, in_f = shape
    dy32 = dy.reshape(-1, out_f).float()
    dx = torch.empty(dy32.shape[0], in_f, dtype=dy.dtype, device=dy.device)
    fp32 = dy.dtype == torch.float32
    # the fp32 sum over reduction blocks, rounded at the end (dx itself in fp32)
    acc = dx if fp32 or not _rows_cut(shape) else torch.empty(dx.shape, device=dy.device)
    for rows_cut, sp, w in _blocks(fill, shape, align, dy.device):
        if not rows_cut:  # dx columns sp, whole reduction: each block rounded as it lands
            r = dx[:, sp] if fp32 else torch.empty(dx.shape[0], w.shape[1], device=dy.device)
            torch.mm(dy32, w, out=r)
            if not fp32:
                dx[:, sp] = r
        elif sp.start == 0:  # reduction span sp (rows of W), summed into every dx column
            torch.mm(dy32[:, sp], w, out=acc)
        else:
            acc.addmm_(dy32[:, sp], w)
    if acc is not dx:
        dx.copy_(acc)
    return dx.view(*dy.shape[:-1], in_f)


@dataclass(frozen=True)
class TracedBlocks:
    """A frozen (out, in) weight handed over in blocks to traced programs (mesp export): each
    block a fresh tensor from `block(rows, cols, dtype)`, no `out=` writes, so torch.export
    traces it and the memory planner reuses one block's bytes for the next (node order is
    lifetime order). The cut keeps the reduction whole: x Wᵀ takes W's rows (output columns)
    and dy W its columns (dx columns), each product concatenated. So every output is one whole
    dot product as with the whole matrix, and there are no partial sums: a chain of adds would
    be one XNNPACK partition holding every partial product at once."""

    block: Callable[[slice, slice, torch.dtype], Tensor]  # W[rows, cols] in dtype
    shape: tuple[int, int]
    align: int  # column cuts in whole quantization groups
    block_bytes: int = WEIGHT_BLOCK_BYTES

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) Wᵀ (+ bias)."""
        _, spans = weight_spans(self.shape, self.align, self.block_bytes, rows_cut=True)
        every = slice(0, None)
        y = torch.cat([x @ self.block(sp, every, x.dtype).t() for sp in spans], -1)
        return y if bias is None else y + bias

    def matmul(self, dy: Tensor) -> Tensor:
        """dy (..., out) W."""
        _, spans = weight_spans(self.shape, self.align, self.block_bytes, rows_cut=False)
        every = slice(0, None)
        return torch.cat([dy @ self.block(every, sp, dy.dtype) for sp in spans], -1)
