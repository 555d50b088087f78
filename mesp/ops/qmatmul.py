"""mesp::qlinear and mesp::qmatmul: the two products of a block with a packed frozen matrix, as one
op each, for the on-device programs (mesp export).

  qlinear(x (..., K), W) -> x Wᵀ (..., N)      qmatmul(dy (..., N), W) -> dy W (..., K)
  qlinear_add(x, W, a, B, s) -> x Wᵀ + s·a Bᵀ   qmatmul_add(dy, W, a, A, s) -> dy W + s·a A

The _add forms are a LoRA linear's forward (a = h = x Aᵀ, B (N, r)) and its dx (a = gh, A
(r, K), s = 1): the addmm a program would otherwise run as mm, mul and add over a second and a
third (tokens × N) tensor is added inside the kernel, block by block, in the same order.

W (N, K) is given as mesp.quant.packed_bytes (uint8, 4, 5, 6 or 8 bits) with its fp32 scales and
biases (N, K/g). In a graph that dequantizes W with ATen ops, the whole fp32 matrix sits in the
planned arena and XNNPACK packs a second copy of it into its workspace: about two fp32 copies of
the largest matrix of a block, per program. The runtimes' kernel (mesp/ondevice/qmatmul.cpp, in the
native runner and in the library the Python driver loads) dequantizes W a block at a time into a
small buffer and multiplies each block with XNNPACK: the same values (w = q·scale + bias, two
roundings) and whole dot products, a megabyte or two of scratch.

Here each op's reference is that graph: dequantize_core_aten, then a matmul. It is what
torch.export traces through and what runs if a program is evaluated in PyTorch; the `.out`
overloads are what ExecuTorch's emitter binds to the runtime kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.quant import QuantSpec, dequantize_core_aten

_ARGS = "Tensor x, Tensor wq, Tensor scales, Tensor biases, int bits, int group_size"
_ADD = f"{_ARGS}, Tensor a, Tensor b, float alpha"
_LIB = torch.library.Library("mesp", "DEF")


def _dense(
    wq: Tensor, scales: Tensor, biases: Tensor, bits: int, group: int, dt: torch.dtype
) -> Tensor:
    return dequantize_core_aten(wq, scales, biases, QuantSpec(bits, group), dt)


def _qlinear(x: Tensor, wq: Tensor, sc: Tensor, bi: Tensor, bits: int, group: int) -> Tensor:
    return F.linear(x, _dense(wq, sc, bi, bits, group, x.dtype))


def _qmatmul(dy: Tensor, wq: Tensor, sc: Tensor, bi: Tensor, bits: int, group: int) -> Tensor:
    return dy @ _dense(wq, sc, bi, bits, group, dy.dtype)


def _plus(y: Tensor, a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """y + alpha · a b as the lowering writes an addmm: mm, mul (where alpha != 1), add."""
    p = a.reshape(-1, a.shape[-1]) @ b
    if alpha != 1:
        p = p * alpha
    return y + p.view(y.shape)


def _adding(product: Callable[..., Tensor], transpose: bool) -> Callable[..., Tensor]:
    """product(x, W) + alpha · a bᵀ (qlinear: b laid out like W, (N, r)) or + alpha · a b
    (qmatmul: b (r, K))."""

    def run(
        x: Tensor,
        wq: Tensor,
        sc: Tensor,
        bi: Tensor,
        bits: int,
        group: int,
        a: Tensor,
        b: Tensor,
        alpha: float,
    ) -> Tensor:
        return _plus(product(x, wq, sc, bi, bits, group), a, b.t() if transpose else b, alpha)

    return run


def _out(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:  # the .out overload of a reference
    def run(*args: object, out: Tensor) -> Tensor:
        y = fn(*args)
        out.resize_(y.shape)
        return out.copy_(y)

    return run


def _meta(linear: bool) -> Callable[..., Tensor]:
    def run(
        x: Tensor, wq: Tensor, sc: Tensor, bi: Tensor, bits: int, group: int, *_: object
    ) -> Tensor:
        width = wq.shape[0] if linear else wq.shape[1] * 8 // bits
        return x.new_empty((*x.shape[:-1], width))

    return run


for _op, _args, _fn, _lin in (
    ("qlinear", _ARGS, _qlinear, True),
    ("qmatmul", _ARGS, _qmatmul, False),
    ("qlinear_add", _ADD, _adding(_qlinear, transpose=True), True),
    ("qmatmul_add", _ADD, _adding(_qmatmul, transpose=False), False),
):
    _LIB.define(f"{_op}({_args}) -> Tensor")
    _LIB.define(f"{_op}.out({_args}, *, Tensor(a!) out) -> Tensor(a!)")
    _LIB.impl(_op, _fn, "CompositeExplicitAutograd")
    _LIB.impl(f"{_op}.out", _out(_fn), "CompositeExplicitAutograd")
    _LIB.impl(_op, _meta(_lin), "Meta")


@dataclass(frozen=True)
class PackedKernel:
    """A frozen (out, in) matrix in packed bytes whose products are mesp's two kernel ops."""

    wq: Tensor  # (out, in·bits/8) uint8
    scales: Tensor  # (out, in/g)
    biases: Tensor  # (out, in/g)
    quant: QuantSpec

    def _args(self) -> tuple[Tensor, Tensor, Tensor, int, int]:
        return self.wq, self.scales, self.biases, self.quant.bits, self.quant.group_size

    def dense(self, dtype: torch.dtype) -> Tensor:
        return _dense(*self._args(), dtype)

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) Wᵀ (+ bias)."""
        y = torch.ops.mesp.qlinear(x, *self._args())
        return y if bias is None else y + bias

    def matmul(self, dy: Tensor) -> Tensor:
        """dy (..., out) W."""
        return torch.ops.mesp.qmatmul(dy, *self._args())

    def linear_add(self, x: Tensor, h: Tensor, b: Tensor, alpha: float) -> Tensor:
        """x (..., in) Wᵀ + alpha · h (..., r) bᵀ, b (out, r): a LoRA linear's output."""
        return torch.ops.mesp.qlinear_add(x, *self._args(), h, b, alpha)

    def matmul_add(self, dy: Tensor, g: Tensor, a: Tensor, alpha: float = 1.0) -> Tensor:
        """dy (..., out) W + alpha · g (..., r) a, a (r, in): a LoRA linear's dx."""
        return torch.ops.mesp.qmatmul_add(dy, *self._args(), g, a, alpha)


KERNEL_BITS = (4, 5, 6, 8)  # the packings mesp/ondevice/qmatmul.cpp reads
KERNEL_OPS = (  # the kernels a runtime must register
    "mesp::qlinear.out",
    "mesp::qmatmul.out",
    "mesp::qlinear_add.out",
    "mesp::qmatmul_add.out",
)

__all__ = ["KERNEL_BITS", "KERNEL_OPS", "PackedKernel"]
