"""Affine group-wise weight quantization, bit-for-bit compatible with ``mlx.core.quantize``.

A weight ``(out, in)`` becomes packed words ``wq`` ``(out, in * bits // 32)``, plus ``scales`` and
``biases`` ``(out, in // group_size)`` with ``w ~= q * scale + bias``. Each row of words is a
little-endian bit stream, value ``j`` at bits ``bits*j .. bits*j + bits - 1`` (at 4 and 8 bits:
value ``j`` of a word in its bits ``bits*j ..``; at 5 and 6 bits a value may straddle two words;
see mesp/quant_pack.py). Words are kept as ``torch.int32`` (MLX's uint32 bit pattern); use
:func:`to_uint32` / :func:`from_uint32` to save / load them as safetensors ``U32``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mesp.errors import MespError
from mesp.ops import native
from mesp.quant_pack import (
    pack,
    packed_bytes,
    tracing,
    unpack_bytes_core_aten,
    unpack_into,
    unpack_values,
)

_EPS = 1e-7  # MLX's floor on the group scale
_CHUNK = 1 << 22  # weight elements quantized per block
# Output bytes dequantized per row block: unpack, scale and shift each block while it is still
# in cache, so the weight makes about one trip through memory instead of three or more, and the
# unpack's int16 scratch stays small; a few blocks per weight keep per-op overhead low.
DEQUANT_BLOCK = 4 << 20
BITS = (4, 5, 6, 8)  # 5 and 6: GGUF's Q5_* and Q6_K codes as stored (loading/gguf_codes.py)


def group_sizes(bits: int) -> tuple[int, ...]:
    """The group sizes allowed at `bits`: 32, 64, 128, and 16 at 6 and 8 bits (llama.cpp's
    Q6_K keeps a scale per 16 weights; 16 six-bit values are 3 whole words)."""
    return (16, 32, 64, 128) if bits in (6, 8) else (32, 64, 128)


@dataclass(frozen=True)
class QuantSpec:
    """Bits per weight (4, 5, 6 or 8) and how many consecutive inputs share a scale and bias."""

    bits: int = 4
    group_size: int = 64

    def __post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in BITS:
            raise MespError(f"quantization bits must be 4, 5, 6 or 8, got {self.bits!r}")
        sizes = group_sizes(self.bits)
        if type(self.group_size) is not int or self.group_size not in sizes:
            raise MespError(
                f"{self.bits}-bit quantization group size must be one of "
                f"{', '.join(map(str, sizes))}, got {self.group_size!r}"
            )

    def words(self, in_features: int) -> int:
        """Packed int32 words of a row of `in_features` values (a whole number of groups)."""
        return in_features * self.bits // 32


def quantize(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize a 2-D float weight to ``(wq int32, scales, biases)``; scales/biases in w.dtype."""
    if w.ndim != 2 or not w.is_floating_point():
        raise MespError(f"can only quantize a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    out_f, in_f = w.shape
    if in_f % spec.group_size:
        raise MespError(f"in_features {in_f} is not a multiple of group size {spec.group_size}")
    groups, dev = (out_f, in_f // spec.group_size), w.device
    wq = torch.empty(out_f, spec.words(in_f), dtype=torch.int32, device=dev)
    scales = torch.empty(groups, dtype=w.dtype, device=dev)
    biases = torch.empty(groups, dtype=w.dtype, device=dev)
    step = max(1, _CHUNK // in_f)  # row blocks bound the float32/int64 temporaries
    for i in range(0, out_f, step):
        wq[i : i + step], scales[i : i + step], biases[i : i + step] = _quantize_rows(
            w.detach()[i : i + step], spec
        )
    return wq, scales, biases


def _quantize_rows(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor]:
    """MLX's affine quantizer (``mlx/backend/cpu/quantized.cpp``), computed in float32: the same
    formula at every width, with 2^bits − 1 steps."""
    rows, n_bins = w.shape[0], float(2**spec.bits - 1)
    g = w.reshape(rows, -1, spec.group_size).float()
    if not bool(torch.isfinite(g).all()):
        raise MespError("cannot quantize a weight that holds NaN or inf")
    w_max, w_min = g.amax(-1), g.amin(-1)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=_EPS)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)  # round half to even, like std::rint
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / q0, scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.sub(g, bias.unsqueeze(-1)).div_(scale.unsqueeze(-1)).round_().clamp_(0, n_bins)
    return pack(q.view(rows, -1), spec.bits), scale.to(w.dtype), bias.to(w.dtype)


def dequantize(
    wq: Tensor, scales: Tensor, biases: Tensor, spec: QuantSpec, dtype: torch.dtype | None = None
) -> Tensor:
    """Rebuild the ``(out, in)`` weight in dtype (default scales.dtype), as ``mx.dequantize``."""
    dtype = scales.dtype if dtype is None else dtype
    shape = _checked_shape(wq, scales, biases, spec, dtype)
    out = torch.empty(shape, dtype=dtype, device=wq.device)
    return _dequantize_into(wq, scales, biases, spec, out)


def _checked_shape(
    wq: Tensor, scales: Tensor, biases: Tensor, spec: QuantSpec, dtype: torch.dtype
) -> tuple[int, int]:
    """The (out, in) shape the packed buffers stand for, after checking they agree."""
    if not dtype.is_floating_point:
        raise MespError(f"can only dequantize to a float dtype, got {dtype}")
    if wq.dtype != torch.int32 or wq.ndim != 2:
        raise MespError(f"packed weight must be 2-D int32, got {wq.dtype} {tuple(wq.shape)}")
    rows, (in_f, odd) = wq.shape[0], divmod(wq.shape[1] * 32, spec.bits)
    groups = (rows, in_f // spec.group_size)
    if odd or in_f % spec.group_size or scales.shape != groups or biases.shape != groups:
        raise MespError(
            f"quantized shapes disagree: wq {tuple(wq.shape)}, scales {tuple(scales.shape)}, "
            f"biases {tuple(biases.shape)} for {spec.bits}-bit group size {spec.group_size}"
        )
    return rows, in_f


def dequantize_into(
    wq: Tensor, scales: Tensor, biases: Tensor, spec: QuantSpec, out: Tensor
) -> Tensor:
    """As :func:`dequantize` in out's dtype, written into `out` (out, in): a scratch buffer
    reused across calls allocates (and page-faults) nothing. Returns out."""
    shape = _checked_shape(wq, scales, biases, spec, out.dtype)
    if out.shape != shape or not out.is_contiguous() or out.device != wq.device:
        raise MespError(
            f"out must be a contiguous {shape} tensor on {wq.device}, got {tuple(out.shape)}"
        )
    return _dequantize_into(wq, scales, biases, spec, out)


def _dequantize_into(
    wq: Tensor, scales: Tensor, biases: Tensor, spec: QuantSpec, out: Tensor
) -> Tensor:
    """Row blocks of about DEQUANT_BLOCK output bytes: unpack straight into out, then one
    in-place multiply and one add per block, broadcasting each group's scale and bias.
    Multiply, round, add, round: the same two roundings as MLX (addcmul would fuse them)."""
    if not tracing() and native.dequantize_into(
        wq, scales, biases, spec.bits, spec.group_size, out
    ):  # one sweep, the same bits (mesp/ops/dequant.c)
        return out
    rows, in_f = out.shape
    s, b = scales.to(out.dtype).unsqueeze(-1), biases.to(out.dtype).unsqueeze(-1)
    if tracing():  # an exported graph: one block, and no loop over a (maybe dynamic) row count
        unpack_into(wq, spec.bits, out)
        out.view(rows, -1, spec.group_size).mul_(s).add_(b)
        return out
    step = max(1, DEQUANT_BLOCK // max(1, in_f * out.element_size()))
    for r in range(0, rows, step):
        o = out[r : r + step]
        unpack_into(wq[r : r + step], spec.bits, o)
        g = o.view(o.shape[0], -1, spec.group_size)
        g.mul_(s[r : r + step]).add_(b[r : r + step])
    return out


def dequantize_rows(
    wq: Tensor,
    scales: Tensor,
    biases: Tensor,
    spec: QuantSpec,
    start: int,
    stop: int,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Dequantize rows ``start:stop`` only (e.g. a vocabulary slice of an embedding or head)."""
    if not 0 <= start <= stop <= wq.shape[0]:
        raise MespError(f"row range {start}:{stop} is outside 0:{wq.shape[0]}")
    return dequantize(wq[start:stop], scales[start:stop], biases[start:stop], spec, dtype)


def dequantize_gather(
    wq: Tensor,
    scales: Tensor,
    biases: Tensor,
    spec: QuantSpec,
    ids: Tensor,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Dequantize the rows at ids (any shape), giving ``ids.shape + (in,)``: an embedding lookup."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise MespError(f"row ids must be int32 or int64, got {ids.dtype}")
    flat = ids.reshape(-1)
    if (
        flat.numel()
        and not flat.is_meta
        and not (0 <= int(flat.min()) and int(flat.max()) < wq.shape[0])
    ):
        raise MespError(f"row ids must lie in 0:{wq.shape[0]}")
    rows = [t.index_select(0, flat) for t in (wq, scales, biases)]
    w = dequantize(rows[0], rows[1], rows[2], spec, dtype)
    return w.view(*ids.shape, w.shape[-1])


def quantized_bytes(
    out_features: int, in_features: int, spec: QuantSpec, scale_dtype: torch.dtype
) -> int:
    """Bytes taken by the packed words plus scales and biases of one quantized weight."""
    if in_features % spec.group_size:
        raise MespError(
            f"in_features {in_features} is not a multiple of group size {spec.group_size}"
        )
    groups = out_features * (in_features // spec.group_size)
    return out_features * in_features * spec.bits // 8 + 2 * groups * scale_dtype.itemsize


def to_uint32(wq: Tensor) -> Tensor:
    """Reinterpret int32 packed words as uint32 (no copy), e.g. to save them as safetensors U32."""
    if wq.dtype != torch.int32:
        raise MespError(f"packed weight must be int32, got {wq.dtype}")
    return wq.view(torch.uint32)


def from_uint32(words: Tensor) -> Tensor:
    """Reinterpret uint32 packed words (as loaded from U32) as int32 (no copy)."""
    if words.dtype == torch.int32:
        return words
    if words.dtype != torch.uint32:
        raise MespError(f"packed weight must be uint32 or int32, got {words.dtype}")
    return words.view(torch.int32)


def dequantize_core_aten(
    wb: Tensor, scales: Tensor, biases: Tensor, spec: QuantSpec, dtype: torch.dtype | None = None
) -> Tensor:
    """:func:`dequantize` of :func:`packed_bytes` in core ATen ops, bit-identical to it: the same
    unpacked values (mesp/quant_pack.py), then the same two roundings (w·scale, then + bias).
    Shapes are checked by the exporter, which calls :func:`dequantize` on the same tensors first."""
    dtype = scales.dtype if dtype is None else dtype
    rows, in_f = wb.shape[0], wb.shape[1] * 8 // spec.bits
    w = unpack_bytes_core_aten(wb, spec.bits, dtype).view(rows, in_f // spec.group_size, -1)
    w = w * scales.to(dtype).unsqueeze(-1)
    w = w + biases.to(dtype).unsqueeze(-1)
    return w.view(rows, in_f)


__all__ = [
    "BITS",
    "QuantSpec",
    "dequantize",
    "dequantize_core_aten",
    "dequantize_gather",
    "dequantize_into",
    "dequantize_rows",
    "from_uint32",
    "group_sizes",
    "packed_bytes",
    "quantize",
    "quantized_bytes",
    "to_uint32",
    "tracing",
    "unpack_values",
]
