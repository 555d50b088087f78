"""mesp::qlinear / mesp::qmatmul: the ExecuTorch kernels of the block programs' 4/5/6/8-bit products
(mesp/ondevice/qmatmul.cpp, built and loaded by mesp.ondevice.kernels), against references.

- Dequantization is exact: one-hot inputs pick columns (x Wᵀ) or rows (dy W) of W, which must
  equal mesp.quant.dequantize's values to the bit, across several blocks of the kernel's cut.
- The products match float64 within a GEMM tolerance, with batch dims and a single row.
- The lowered program plans no fp32 copy of W (the point of the ops).
- Beside them, the embedding's lookup, which dequantizes in the graph (core ATen), is exact on
  the runtime at every width.
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
from mesp.quant import QuantSpec, dequantize, dequantize_core_aten, packed_bytes, quantize
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


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (5, 32), (6, 16)])
def test_one_hot_products_give_the_dequantized_matrix_exactly(bits: int, group: int) -> None:
    # N = 4100 rows of K = 128: row blocks of 512 for x Wᵀ (256 KiB) and column blocks of 32
    # for dy W (640 KiB at most, in sixteens: at groups of 64 a block ends inside a group), so
    # every block boundary is crossed; at 5 and 6 bits columns 1, 31, 63 straddle bytes (and 63
    # a word at 5 bits)
    n, k, spec = 4100, 128, QuantSpec(bits, group)
    w, dense = _packed(n, k, spec, bits)
    cols = torch.tensor([0, 1, 31, 32, 47, 48, 63, 64, 95, 96, 127])
    rows = torch.tensor([0, 1, 2047, 2048, 4095, 4096, 4099])
    x = torch.nn.functional.one_hot(cols, k).float()  # (11, K): picks W[:, cols]
    dy = torch.nn.functional.one_hot(rows, n).float()  # (7, N): picks W[rows, :]
    args = [x, dy, w.wq, w.scales, w.biases]
    (out,), low = _run(lambda d: _products(d, spec), args)
    y, dx = out[: len(cols) * n].view(-1, n), out[len(cols) * n :].view(7, k)
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


@pytest.mark.parametrize(("bits", "group"), [(5, 32), (6, 16), (4, 32), (8, 16)])
def test_embedding_rows_unpack_exactly_on_the_runtime(bits: int, group: int) -> None:
    """The embedding program's lookup (edge_programs.embed: rows of the packed bytes, then
    dequantize_core_aten) on the runtime gives dequantize's bits at every width: 5 and 6 bits
    (GGUF's Q5 / Q6_K codes as stored) in integer ops without a shift, values straddling bytes."""
    spec = QuantSpec(bits, group)
    g = torch.Generator().manual_seed(bits)
    wq, sc, bi = quantize(torch.randn(40, 96, generator=g), spec)
    ids = torch.tensor([0, 7, 39, 7, 21])

    def fn(d: Named) -> Named:
        sel = [d[k].index_select(0, d["a3"]) for k in ("a0", "a1", "a2")]
        return {"y": dequantize_core_aten(sel[0], sel[1], sel[2], spec, None)}

    (y,), _ = _run(fn, [packed_bytes(wq), sc, bi, ids])
    assert torch.equal(y, dequantize(wq, sc, bi, spec)[ids])


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (5, 32), (6, 16), (8, 64), (5, 128)])
@pytest.mark.parametrize("vector", [0, 1], ids=["scalar", "avx2"])
def test_both_dequantizers_give_dequantize_bits(bits: int, group: int, vector: int) -> None:
    """The kernels' two forms of the dequantizer (packed_rows.h: eight scalar conversions, and
    on x86-64 with AVX2 eight lanes at once) give dequantize's values to the bit, for blocks of
    rows and blocks of columns that start and end inside a group."""
    import ctypes

    spec, n, k = QuantSpec(bits, group), 37, 512
    w, dense = _packed(n, k, spec, bits * group)
    lib = ctypes.CDLL(str(load_kernels()))
    f, u8 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint8)

    def block(linear: bool, b0: int, length: int) -> Tensor:
        out = torch.full((length, k) if linear else (n, length), float("nan"))
        rc = lib.mesp_dequantize_block(
            ctypes.cast(w.wq.data_ptr(), u8), ctypes.cast(w.scales.data_ptr(), f),
            ctypes.cast(w.biases.data_ptr(), f), ctypes.c_int64(n), ctypes.c_int64(k),
            ctypes.c_int64(bits), ctypes.c_int64(group), ctypes.c_int(int(linear)),
            ctypes.c_int64(b0), ctypes.c_int64(length), ctypes.c_int(vector),
            ctypes.cast(out.data_ptr(), f),
        )  # fmt: skip
        if rc != 0:
            pytest.skip("no AVX2 form on this CPU or build")
        return out

    assert torch.equal(block(True, 0, n), dense)
    assert torch.equal(block(True, 5, 17), dense[5:22])
    for c0, c1 in [(0, k), (8, 40), (24, 264), (496, 512)]:
        assert torch.equal(block(False, c0, c1 - c0), dense[:, c0:c1])


_GUARD = r"""
import ctypes, mmap, sys
import torch
from mesp.ondevice.kernels import load_kernels

lib = ctypes.CDLL(str(load_kernels()))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
page = mmap.PAGESIZE
f = ctypes.POINTER(ctypes.c_float)


def at_guard(t):  # t's values ending exactly where an unreadable page begins
    size = t.numel() * 4
    span = (size + page - 1) // page * page
    mm = mmap.mmap(-1, span + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert libc.mprotect(base + span, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    ctypes.memmove(base + span - size, t.data_ptr(), size)
    keep.append(mm)
    return ctypes.cast(base + span - size, f)


keep = []
for m, k, n in [(1, 8, 16), (5, 13, 7), (3, 1, 5), (7, 33, 64), (256, 896, 96)]:
    g = torch.Generator().manual_seed(m * k * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = torch.full((m, n), float("nan"))
    rc = lib.mesp_fully_connected_f32(
        at_guard(x), ctypes.c_size_t(m), ctypes.c_size_t(k), at_guard(w), ctypes.c_size_t(n),
        ctypes.cast(y.data_ptr(), f),
    )
    ref = (x.double() @ w.double().T).float()
    assert rc == 0 and torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * k**0.5), (m, k, n)
print("ok")
"""


def test_inputs_ending_at_an_unreadable_page() -> None:
    """XNNPACK may read up to 16 bytes past its input (XNN_EXTRA_BYTES); ExecuTorch tensors
    promise no such slack, so the kernels run every row but the last in place and the last from
    a padded copy. Here the input and the weights end exactly where a PROT_NONE page begins (a
    read past either is a SIGSEGV of the child), over shapes with every remainder of K against
    the SIMD widths, one row and many; the products are still right."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _GUARD], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])
