"""mesp::qlinear_add / mesp::qmatmul_add: a LoRA linear's forward (x Wᵀ + s·h Bᵀ) and its dx
(dy W + gh A) as one kernel op each (mesp/ondevice/qmatmul.cpp), against the written-out graph
they replace (the quantized product, then mm, mul and add on XNNPACK) and against float64.

The kernel adds the LoRA term one block of output columns at a time, so the shapes cross the
kernel's blocks (N = 4100 rows of K = 128: three row blocks; dy W in column blocks), and run
with batch dims, with a single row and with s = 1 and s ≠ 1.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from mesp.ondevice.kernels import load_kernels
from mesp.ondevice.lower import lower
from mesp.ondevice.steps import Flat, Named
from mesp.ops.qmatmul import PackedKernel
from mesp.quant import QuantSpec, dequantize, packed_bytes, quantize
from tests.tolerances import gemm_tol

pytest.importorskip("executorch")

N, K, R = 4100, 128, 8


def _run(fn, args: list[Tensor]) -> Tensor:  # type: ignore[no-untyped-def]
    from executorch.runtime import Runtime

    load_kernels()
    low = lower(Flat(fn, [f"a{i}" for i in range(len(args))], ["y"]), args, {})
    assert max(low.planned) < N * K * 4  # neither W nor a (tokens × N) product beside y twice
    return Runtime.get().load_program(low.pte).load_method("forward").execute(args)[0].clone()


def _case(
    spec: QuantSpec, lead: tuple[int, ...], seed: int
) -> tuple[PackedKernel, Tensor, list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    wq, s, b = quantize(torch.randn(N, K, generator=g) * 0.05, spec)
    w = PackedKernel(packed_bytes(wq), s, b, spec)
    x, dy = torch.randn(*lead, K, generator=g), torch.randn(*lead, N, generator=g)
    h, gh = torch.randn(*lead, R, generator=g), torch.randn(*lead, R, generator=g)
    lb, la = torch.randn(N, R, generator=g) * 0.1, torch.randn(R, K, generator=g) * 0.1
    return (
        w,
        dequantize(wq, s, b, spec, torch.float32),
        [x, dy, h, gh, lb, la, w.wq, w.scales, w.biases],
    )


def _fused(spec: QuantSpec, s: float):  # type: ignore[no-untyped-def]
    def fn(d: Named) -> Named:
        w = PackedKernel(d["a6"], d["a7"], d["a8"], spec)
        y = w.linear_add(d["a0"], d["a2"], d["a4"], s)
        dx = w.matmul_add(d["a1"], d["a3"], d["a5"])
        return {"y": torch.cat([y.flatten(), dx.flatten()])}

    return fn


def _written_out(spec: QuantSpec, s: float):  # type: ignore[no-untyped-def]
    def fn(d: Named) -> Named:  # what the programs ran before: product, then mm, mul and add
        w = PackedKernel(d["a6"], d["a7"], d["a8"], spec)
        y = w.linear(d["a0"]) + (d["a2"] @ d["a4"].t()) * s
        dx = w.matmul(d["a1"]) + d["a3"] @ d["a5"]
        return {"y": torch.cat([y.flatten(), dx.flatten()])}

    return fn


@pytest.mark.parametrize(
    ("bits", "group", "lead", "s"), [(4, 32, (2, 3), 2.0), (5, 32, (1,), 1.0), (6, 16, (7,), 0.5)]
)
def test_fused_lora_products(bits: int, group: int, lead: tuple[int, ...], s: float) -> None:
    spec = QuantSpec(bits, group)
    _, dense, args = _case(spec, lead, bits)
    got = _run(_fused(spec, s), args)
    x, dy, h, gh, lb, la = (t.double().reshape(-1, t.shape[-1]) for t in args[:6])
    m = x.shape[0]
    ref_y = x @ dense.double().t() + s * (h @ lb.t())
    ref_dx = dy @ dense.double() + gh @ la
    rtol, atol = gemm_tol(N, scale=0.1)
    torch.testing.assert_close(got[: m * N].double(), ref_y.flatten(), rtol=rtol, atol=atol)
    torch.testing.assert_close(got[m * N :].double(), ref_dx.flatten(), rtol=rtol, atol=atol)
    # the graph they replace, on the same runtime: the same sums in the same order
    old = _run(_written_out(spec, s), args)
    rtol, atol = gemm_tol(R, scale=0.1)  # at most the LoRA term's own summation order
    torch.testing.assert_close(got, old, rtol=rtol, atol=atol)
