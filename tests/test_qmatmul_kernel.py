"""mesp::qlinear / mesp::qmatmul: the ExecuTorch kernels of the block programs' 4/8-bit products
(mesp/ondevice/qmatmul.cpp, built and loaded by mesp.ondevice.kernels), against references.

- Dequantization is exact: one-hot inputs pick columns (x Wᵀ) or rows (dy W) of W, which must
  equal mesp.quant.dequantize's values to the bit, across several blocks of the kernel's cut.
- The products match float64 within a GEMM tolerance, with batch dims and a single row.
- The lowered program plans no fp32 copy of W (the point of the ops).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from mesp.ondevice.kernels import load_kernels
from mesp.ondevice.lower import Lowered, lower
from mesp.ondevice.steps import Flat, Named
from mesp.ops.qmatmul import PackedKernel
from mesp.quant import QuantSpec, dequantize, packed_bytes, quantize
from tests.tolerances import gemm_tol

pytest.importorskip("executorch")


def _packed(n: int, k: int, spec: QuantSpec, seed: int) -> tuple[PackedKernel, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wq, s, b = quantize(torch.randn(n, k, generator=g) * 0.05, spec)
    return PackedKernel(packed_bytes(wq), s, b, spec), dequantize(wq, s, b, spec, torch.float32)


def _run(fn: Callable[[Named], Named], args: list[Tensor]) -> tuple[list[Tensor], Lowered]:
    from executorch.runtime import Runtime

    load_kernels()
    low = lower(Flat(fn, [f"a{i}" for i in range(len(args))], ["y"]), args, {})
    method = Runtime.get().load_program(low.pte).load_method("forward")
    return [t.clone() for t in method.execute(args)], low


def _tol(k: int) -> dict[str, float]:  # inputs of std 1 against weights of std 0.05
    rtol, atol = gemm_tol(k, scale=0.05)
    return {"rtol": rtol, "atol": atol}


def _products(d: Named, spec: QuantSpec) -> Named:
    w = PackedKernel(d["a2"], d["a3"], d["a4"], spec)
    return {"y": torch.cat([w.linear(d["a0"]).flatten(), w.matmul(d["a1"]).flatten()])}


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_one_hot_products_give_the_dequantized_matrix_exactly(bits: int, group: int) -> None:
    # N = 4100 rows of K = 128: 3 row blocks for x Wᵀ (2048 rows per MiB) and 4 column blocks
    # (32 columns each) for dy W, so every block boundary is crossed
    n, k, spec = 4100, 128, QuantSpec(bits, group)
    w, dense = _packed(n, k, spec, bits)
    cols = torch.tensor([0, 1, 31, 32, 63, 64, 127])
    rows = torch.tensor([0, 1, 2047, 2048, 4095, 4096, 4099])
    x = torch.nn.functional.one_hot(cols, k).float()  # (7, K): picks W[:, cols]
    dy = torch.nn.functional.one_hot(rows, n).float()  # (7, N): picks W[rows, :]
    args = [x, dy, w.wq, w.scales, w.biases]
    (out,), low = _run(lambda d: _products(d, spec), args)
    y, dx = out[: 7 * n].view(7, n), out[7 * n :].view(7, k)
    assert torch.equal(y, dense[:, cols].t())
    assert torch.equal(dx, dense[rows])
    assert max(low.planned) < n * k * 4  # no fp32 W in the arena


def test_products_match_float64_with_batch_dims_and_one_row() -> None:
    n, k, spec = 300, 192, QuantSpec(4, 64)
    w, dense = _packed(n, k, spec, 7)
    g = torch.Generator().manual_seed(1)
    for lead in ((2, 5), (1,)):
        x, dy = torch.randn(*lead, k, generator=g), torch.randn(*lead, n, generator=g)
        (out,), _ = _run(lambda d: _products(d, spec), [x, dy, w.wq, w.scales, w.biases])
        m = x[..., 0].numel()
        ref_y = (x.double().reshape(m, k) @ dense.double().t()).flatten()
        ref_dx = (dy.double().reshape(m, n) @ dense.double()).flatten()
        y, dx = out[: m * n], out[m * n :]
        torch.testing.assert_close(y.double(), ref_y, **_tol(k))
        torch.testing.assert_close(dx.double(), ref_dx, **_tol(n))
