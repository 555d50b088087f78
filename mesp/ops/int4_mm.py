"""4-bit decoding through torch's int4 CPU kernel: short rows times an MLX 4-bit weight, no
dequantized copy.

At one token a step, `dequantize` + matmul pays a full sweep that writes the float weight for a
matrix-vector product that reads it once (several times a dense fp32 matmul: `mesp bench
decode`). `aten._weight_int4pack_mm_for_cpu` reads the packed nibbles directly (AVX2, bf16
activations; its fp32 form has no fast path).

Layouts. MLX stores w = q·s + b per group (q in 0..15, s and b per (row, group)). The kernel
computes w = (q − 8)·s + z, so the same q with z = b + 8·s gives the same w. The kernel takes
s and z in its bf16 activation dtype: 8·s is exact, and so is b + 8·s for groups centred on
zero, but off-centre groups can round (about 8% of them in tests), so a decoded weight may
differ from the dequantized one by half a bf16 ulp of z: bf16 rounding, the size of rounding
the activations. The packed layout is
opaque (`aten._convert_weight_to_int4pack_for_cpu` of the unpacked (N, K) values); scales and
zeros go as one (K/g, N, 2) tensor. The packer wants N a multiple of 16: other weights get zero
rows (q = 0, s = z = 0, so w = 0) and the output is sliced back.

The packed copy is for inference only (no `dy @ W` form, and 2x slower than dense at 256 rows):
the MLX buffers stay the source of truth, and the copy is counted wherever the weight's bytes
are (`FrozenWeight.nbytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mesp.quant import QuantSpec, unpack_values

# Rows (tokens) up to which the int4 kernel beats dequantize + matmul; longer inputs (prefill,
# evaluation, training) keep the dequantizing path. Measured with `mesp bench decode`.
DECODE_ROWS = 16
_N_MULTIPLE = 16  # the CPU packer's requirement on the output size
_COMPUTE = torch.bfloat16  # the kernel's fast activation dtype on AVX2 (fp32 has no fast path)


@dataclass
class Int4Pack:
    """One weight in the kernel's layout: packed nibbles, (K/g, N_pad, 2) scales and zeros."""

    packed: Tensor
    scales_zeros: Tensor
    group_size: int
    out_features: int  # N before padding
    source: tuple[int, ...] = ()  # identity of the buffers it was packed from (set by owner)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))


def supported(wq: Tensor, spec: QuantSpec) -> bool:
    """A 4-bit weight on the CPU (the kernel's only home here)."""
    return spec.bits == 4 and wq.device.type == "cpu" and not wq.is_meta


def pack(wq: Tensor, scales: Tensor, biases: Tensor, spec: QuantSpec) -> Int4Pack:
    """(out, in·4/32) int32 words + (out, in/g) scales, biases -> the kernel's layout."""
    if not supported(wq, spec):
        raise ValueError(f"int4 decoding needs a 4-bit CPU weight, got {spec.bits}-bit {wq.device}")
    n = wq.shape[0]
    pad = -n % _N_MULTIPLE
    q = unpack_values(wq, 4, torch.int32)  # (N, K) values 0..15
    s, b = scales.float(), biases.float()
    z = b + 8.0 * s
    if pad:
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        s, z = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (s, z))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous().to(_COMPUTE)  # (K/g, N_pad, 2)
    return Int4Pack(packed, sz, spec.group_size, n)


def int4_linear(x: Tensor, p: Int4Pack) -> Tensor:
    """x (..., K) -> (..., N) = x Wᵀ in x.dtype, computed with bf16 activations (fp32 sums)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(_COMPUTE).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, p.packed, p.group_size, p.scales_zeros)
    if y.shape[-1] != p.out_features:
        y = y[:, : p.out_features]
    return y.to(x.dtype).reshape(*lead, p.out_features)


def short_rows(x: Tensor) -> bool:
    """Few enough rows that the int4 kernel is the faster path."""
    return x.numel() // max(1, x.shape[-1]) <= DECODE_ROWS
