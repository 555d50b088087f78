"""The native one-sweep dequantizer (mesp/ops/dequant.c) against mesp.quant's pure-torch path.

Bit-identical for 4, 5, 6 and 8 bits, every group size, fp32 / bf16 scales and outputs, row blocks
and group ranges; the torch path is the reference (MLX's two roundings, tests/test_quant.py).
Without a compiler the kernel is not built and the torch path serves, with one log line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mesp import quant
from mesp.ops import native
from mesp.quant import BITS, QuantSpec, dequantize, group_sizes, quantize

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def _torch_path(wq, s, b, spec, dtype):
    """mesp.quant's pure-torch dequantizer, with the kernel out of the way."""
    out = torch.empty(wq.shape[0], wq.shape[1] * 32 // spec.bits, dtype=dtype)
    lib = native.library
    try:
        native.library = lambda: None  # type: ignore[assignment]
        return quant._dequantize_into(wq, s, b, spec, out)
    finally:
        native.library = lib  # type: ignore[assignment]


def _packed(rows, cols, spec, scale_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.1
    wq, s, b = quantize(w.to(scale_dtype), spec)
    return wq, s, b


def test_kernel_is_built_where_a_compiler_is():
    assert native.library() is not None, "a C compiler is present, so the kernel must build"


@pytest.mark.parametrize(("bits", "group"), [(b, g) for b in BITS for g in group_sizes(b)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_to_torch_path(bits, group, scale_dtype, out_dtype):
    spec = QuantSpec(bits, group)
    wq, s, b = _packed(67, 3 * group, spec, scale_dtype, seed=bits + group)
    want = _torch_path(wq, s, b, spec, out_dtype)
    got = dequantize(wq, s, b, spec, out_dtype)
    assert got.dtype == out_dtype
    bits_of = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits_of), want.view(bits_of))  # NaN-free: equal bits


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_large_weight_threads_bit_identical(scale_dtype):
    """Big enough for the kernel's threaded loop (Qwen2.5-0.5B's MLP shape)."""
    spec = QuantSpec(4, 64)
    wq, s, b = _packed(4864, 896, spec, scale_dtype)
    want = _torch_path(wq, s, b, spec, scale_dtype)
    assert torch.equal(dequantize(wq, s, b, spec), want)


def test_bf16_math_into_fp32_out_is_the_bf16_weight_widened():
    spec = QuantSpec(4, 64)
    wq, s, b = _packed(40, 256, spec, torch.bfloat16)
    out = torch.empty(40, 256)
    assert native.dequantize_into(wq, s, b, 4, 64, out, bf16_math=True)
    assert torch.equal(out, dequantize(wq, s, b, spec, torch.bfloat16).float())


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_group_range_into_a_strided_block(bits):
    spec = QuantSpec(bits, 32)
    wq, s, b = _packed(12, 320, spec, torch.float32)
    full = dequantize(wq, s, b, spec)
    big = torch.full((12, 200), -1.0)
    block = big[:, 10:106]  # 3 groups of 32, rows 200 elements apart
    assert native.dequantize_into(wq, s, b, bits, 32, block, groups=(4, 7))
    assert torch.equal(block, full[:, 128:224])
    assert bool((big[:, :10] == -1).all() and (big[:, 106:] == -1).all())


def test_declines_what_it_does_not_serve():
    spec = QuantSpec(4, 64)
    wq, s, b = _packed(8, 128, spec, torch.float32)
    assert not native.dequantize_into(wq, s, b, 4, 64, torch.empty(8, 128, dtype=torch.float16))
    assert not native.dequantize_into(wq, s, b, 4, 64, torch.empty(8, 64))  # wrong shape
    # fp16 still dequantizes, through torch
    assert torch.equal(
        dequantize(wq, s, b, spec, torch.float16), _torch_path(wq, s, b, spec, torch.float16)
    )


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )  # fmt: skip


_CHECK = (
    "import torch; from mesp.ops import native\n"
    "from mesp.quant import QuantSpec, quantize, dequantize\n"
    "sp = QuantSpec(4, 64); torch.manual_seed(0); w = torch.randn(16, 128)\n"
    "print(native.library() is not None, float(dequantize(*quantize(w, sp), sp).sum()))\n"
)


def test_no_compiler_falls_back_with_one_line(tmp_path):
    done = _run(_CHECK, CC=str(tmp_path / "no-such-cc"), MESP_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "False"
    lines = [ln for ln in done.stderr.splitlines() if "pure-torch" in ln]
    assert len(lines) == 1 and "no C compiler" in lines[0], done.stderr
    built = _run(_CHECK, MESP_CACHE_DIR=str(tmp_path))
    assert built.stdout.split() == ["True", done.stdout.split()[1]], built.stderr


def test_concurrent_first_builds_all_succeed(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHECK], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "MESP_CACHE_DIR": str(tmp_path)})
        for _ in range(3)
    ]  # fmt: skip
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(o[0] == "True" for o in outs) and len({o[1] for o in outs}) == 1
    assert [p.name for p in (tmp_path / "native").iterdir()] == [
        native.library_path(native.compiler()).name
    ]


def test_env_turns_it_off():
    done = _run(_CHECK, MESP_NATIVE="off")
    assert done.returncode == 0 and done.stdout.split()[0] == "False"
    assert "pure-torch" not in done.stderr
