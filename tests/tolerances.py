"""Tolerances for comparing two kernels that compute the same GEMM in different orders.

An output of a GEMM with inner dimension k is a sum of k products. Two kernels (XNNPACK and
torch's, a blocked native path and one GEMM, numpy's BLAS and torch's) add them in different
orders and blockings, with or without FMA, so their results differ by rounding: each partial
sum is rounded to the dtype's eps, and the partial sums grow like sqrt(j) times the products'
scale, which adds up to about eps·k·scale over the sum (seen: 3.6e-5 = 0.6·eps·k for k = 512
of randn·randn on an AVX-512 Xeon). The bounds below are 4x that, and a relative term of
4·eps·sqrt(k) for outputs much larger than the products; both are orders of magnitude below
what a wrong formula, a dropped term or a wrong mask gives. Paths meant to be bit-identical
(the same kernel on the same operands) keep torch.equal.
"""

from __future__ import annotations

import math

import torch


def gemm_tol(k: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> tuple[float, float]:
    """(rtol, atol) for torch.testing.assert_close between two GEMM kernels: inner dimension k,
    `scale` the typical magnitude of one product a_i·b_i (e.g. std(a)·std(b))."""
    eps = torch.finfo(dtype).eps
    return 4 * eps * math.sqrt(k), 4 * eps * k * float(scale)
