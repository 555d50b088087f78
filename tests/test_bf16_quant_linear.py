"""bf16 matmuls on a quantized base where the CPU has no bf16 GEMM (FrozenWeight.linear/matmul):
the weight's bf16 values are dequantized straight into fp32 row blocks for the fp32 GEMM.

They must compute what a native bf16 GEMM does on the bf16 dequantized weight: bf16 operands,
fp32 accumulation, one rounding. The reference is that in float64 (exact products, one sum),
rounded once; fp32 accumulation may differ from it by far less than a bf16 step.
"""

from __future__ import annotations

import pytest
import torch

from mesp.models.linear import FrozenWeight, frozen_matmul
from mesp.ops import matmul as matmul_ops
from mesp.ops import native
from mesp.quant import QuantSpec
from tests.tolerances import gemm_tol

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def _fp32_gemm(monkeypatch):
    monkeypatch.setenv(matmul_ops.ENV, "fp32")  # the path of CPUs without a bf16 GEMM


def _weight(out_f, in_f, bits=4, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    fw = FrozenWeight(out_f, in_f, torch.bfloat16)
    fw.set_dense((torch.randn(out_f, in_f, generator=g) * 0.05).bfloat16(), QuantSpec(bits, group))
    return fw, g


def _close_to_one_rounding(got, exact64, magnitude64):
    """got (bf16) is exact64 rounded once, up to fp32-accumulation noise: within one bf16 step
    of it, plus fp32's relative error on the sum of |terms| (magnitude64) where terms cancel."""
    want = exact64.to(torch.bfloat16)
    step = exact64.abs() * 2**-7 + magnitude64 * 2**-20
    assert got.dtype == torch.bfloat16
    assert bool(((got.double() - exact64).abs() <= step).all())
    assert (got != want).float().mean() < 0.02  # almost every element is the one rounding


# (out, in): one block; several row blocks (gate/up shape); blocks of a long row (down shape)
SHAPES = [(96, 128), (4864, 896), (896, 4864)]


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_forward_and_backward_are_a_bf16_gemm(out_f, in_f, bits):
    fw, g = _weight(out_f, in_f, bits)
    assert fw._blocked(torch.empty(1, dtype=torch.bfloat16))
    w64 = fw.dense(torch.bfloat16).double()  # the bf16 dequantized weight, exactly
    x = torch.randn(3, 37, in_f, generator=g).bfloat16()
    dy = torch.randn(3, 37, out_f, generator=g).bfloat16()
    bias = torch.randn(out_f, generator=g).bfloat16()
    fwd = x.double().abs() @ w64.abs().t()
    _close_to_one_rounding(fw.linear(x), x.double() @ w64.t(), fwd)
    _close_to_one_rounding(fw.linear(x, bias), x.double() @ w64.t() + bias.double(), fwd)
    _close_to_one_rounding(fw.matmul(dy), dy.double() @ w64, dy.double().abs() @ w64.abs())


def test_one_block_is_the_upcast_path_bit_for_bit():
    fw, g = _weight(96, 128)
    x = torch.randn(5, 128, generator=g).bfloat16()
    dy = torch.randn(5, 96, generator=g).bfloat16()
    w = fw.dense(torch.bfloat16)
    assert torch.equal(fw.linear(x), (x.float() @ w.float().t()).bfloat16())
    assert torch.equal(fw.matmul(dy), (dy.float() @ w.float()).bfloat16())


def test_autograd_through_frozen_matmul_uses_it():
    fw, g = _weight(640, 256)
    x = torch.randn(7, 256, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(7, 640, generator=g).bfloat16()
    y = frozen_matmul(x, fw)
    y.backward(dy)
    assert torch.equal(y, fw.linear(x.detach()))
    assert torch.equal(x.grad, fw.matmul(dy))


def test_not_taken_elsewhere(monkeypatch):
    fw, _ = _weight(64, 128)
    assert fw._blocked(torch.empty(1))  # fp32 activations: blocked too (tests/test_native_dequant)
    assert not fw._blocked(torch.empty(1, dtype=torch.float16))
    monkeypatch.setenv(matmul_ops.ENV, "native")
    assert not fw._blocked(torch.empty(1, dtype=torch.bfloat16))  # a bf16 GEMM is used
    dense = FrozenWeight(64, 128, torch.bfloat16)
    dense.set_dense(torch.randn(64, 128).bfloat16())
    monkeypatch.setenv(matmul_ops.ENV, "fp32")
    assert not dense._blocked(torch.empty(1, dtype=torch.bfloat16))


def test_export_traces_the_torch_ops_not_the_kernel():
    """torch.export of a quantized linear: the blocked native path is for eager runs; traced
    programs keep quant's torch ops (what ExecuTorch lowers), and compute the same numbers."""
    fw, g = _weight(96, 128)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fw = fw

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return frozen_matmul(x, self.fw)

    x = torch.randn(4, 128, generator=g)
    ep = torch.export.export(M(), (x,))
    rtol, atol = gemm_tol(128, scale=0.05)  # dequantize + one GEMM vs the blocked path; |w| ~ 0.05
    torch.testing.assert_close(ep.module()(x), frozen_matmul(x, fw), rtol=rtol, atol=atol)
