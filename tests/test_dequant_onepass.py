"""The blocked one-sweep dequantizer gives exactly the bits of the implementation it replaced
(kept below as the reference; at 5 and 6 bits, which it never had, the layout spelled out with
numpy's bit unpacking): random words, 4, 5, 6 and 8 bits, groups 32/64/128, fp32/bf16/fp16, one
block or many, whole weights, row slices, gathers and a reused output buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mesp import quant, quant_pack
from mesp.errors import MespError
from mesp.quant import (
    QuantSpec,
    dequantize,
    dequantize_gather,
    dequantize_into,
    dequantize_rows,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN and inf included (fp16 overflows at these magnitudes)."""
    return a.dtype == b.dtype and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def reference_unpack(wq: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """quant._unpack before the one-sweep rewrite: two strided nibble copies. 5 and 6 bits:
    each row's bytes as a little-endian bit array, value j its bits bits·j .. bits·j + bits − 1."""
    b = wq.contiguous().view(torch.uint8)
    if bits in (5, 6):
        one = np.unpackbits(b.numpy(), axis=-1, bitorder="little").reshape(b.shape[0], -1, bits)
        return torch.from_numpy((one.astype(np.int64) << np.arange(bits)).sum(-1)).to(dtype)
    if bits == 8:
        return b.to(dtype)
    out = torch.empty(b.shape[0], b.shape[1], 2, dtype=dtype, device=wq.device)
    out[..., 0].copy_(b & 15)
    out[..., 1].copy_(b >> 4)
    return out.view(b.shape[0], 2 * b.shape[1])


def reference_dequantize(wq, scales, biases, spec, dtype=None):  # type: ignore[no-untyped-def]
    """quant.dequantize before the rewrite: unpack, then w·scale rounded, then + bias rounded."""
    dtype = scales.dtype if dtype is None else dtype
    rows, in_f = wq.shape[0], wq.shape[1] * 32 // spec.bits
    w = reference_unpack(wq, spec.bits, dtype).view(rows, in_f // spec.group_size, -1)
    w.mul_(scales.to(dtype).unsqueeze(-1)).add_(biases.to(dtype).unsqueeze(-1))
    return w.view(rows, in_f)


def packed(rows: int, in_f: int, spec: QuantSpec, store: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    """Random words (every bit pattern), scales and biases of mixed sign and magnitude."""
    g = torch.Generator().manual_seed(seed)
    wq = torch.randint(-(2**31), 2**31, (rows, spec.words(in_f)), generator=g)
    groups = (rows, in_f // spec.group_size)
    mag = torch.exp(torch.randn(groups, generator=g) * 3)  # e^-9 .. e^9: rounding everywhere
    scales = (torch.randn(groups, generator=g) * mag).to(store)
    biases = (torch.randn(groups, generator=g) * mag * 8).to(store)
    return wq.to(torch.int32), scales, biases


@pytest.mark.parametrize("store", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_bit_identical_to_the_old_dequantize(
    bits: int, group: int, dtype: torch.dtype, store: torch.dtype, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    spec = QuantSpec(bits, group)
    wq, s, b = packed(37, 4 * 128, spec, store, seed=bits + group)
    ref = reference_dequantize(wq, s, b, spec, dtype)
    assert same_bits(dequantize(wq, s, b, spec, dtype), ref)  # one block
    monkeypatch.setattr(quant, "DEQUANT_BLOCK", 3 * 512 * 2)  # many blocks, a short last one
    got = dequantize(wq, s, b, spec, dtype)
    assert same_bits(got, ref)
    assert same_bits(dequantize(wq, s, b, spec), reference_dequantize(wq, s, b, spec))
    assert torch.equal(quant_pack.unpack_values(wq, bits, dtype), reference_unpack(wq, bits, dtype))
    assert torch.equal(quant_pack.unpack_shift(wq, bits, dtype), reference_unpack(wq, bits, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_rows_gather_and_a_reused_buffer(bits: int, dtype: torch.dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(quant, "DEQUANT_BLOCK", 4096)
    spec = QuantSpec(bits, 64)
    wq, s, b = packed(50, 256, spec, dtype, seed=3)
    ref = reference_dequantize(wq, s, b, spec)
    assert torch.equal(dequantize_rows(wq, s, b, spec, 7, 31), ref[7:31])
    assert dequantize_rows(wq, s, b, spec, 5, 5).shape == (0, 256)
    ids = torch.tensor([[3, 49, 3], [0, 17, 22]])
    assert torch.equal(dequantize_gather(wq, s, b, spec, ids), ref[ids])
    out = torch.full((50, 256), float("nan"), dtype=dtype)
    for seed in (4, 5):  # the same buffer twice: nothing of the first call survives
        wq, s, b = packed(50, 256, spec, dtype, seed=seed)
        assert dequantize_into(wq, s, b, spec, out) is out
        assert torch.equal(out, reference_dequantize(wq, s, b, spec))


def test_into_refuses_a_buffer_that_does_not_fit() -> None:
    spec = QuantSpec(4, 32)
    wq, s, b = packed(4, 64, spec, torch.float32)
    for bad in (torch.empty(4, 63), torch.empty(64, 4).t(), torch.empty(4, 64, dtype=torch.int32)):
        with pytest.raises(MespError):
            dequantize_into(wq, s, b, spec, bad)
    with pytest.raises(MespError, match="disagree"):
        dequantize_into(wq, s[:3], b, spec, torch.empty(4, 64))


def test_meta_device_keeps_shape_and_dtype() -> None:
    spec = QuantSpec(4, 64)
    wq, s, b = (t.to("meta") for t in packed(8, 128, spec, torch.bfloat16))
    w = dequantize(wq, s, b, spec, torch.float32)
    assert w.is_meta and w.shape == (8, 128) and w.dtype == torch.float32


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_an_exported_program_holds_one_block_of_the_same_ops(bits: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under torch.export (the on-device programs) the blocks are not unrolled into the graph,
    the unpack keeps its uint8 ops, and the program computes the same bits."""
    monkeypatch.setattr(quant, "DEQUANT_BLOCK", 1024)
    spec = QuantSpec(bits, 32)
    wq, s, b = packed(16, 128, spec, torch.float32, seed=6)

    class Deq(torch.nn.Module):
        def forward(self, wq: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return dequantize(wq, s, b, spec)

    ep = torch.export.export(Deq(), (wq, s, b))
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert ops.count("aten.mul_.Tensor") == 1 and not any("int16" in o for o in ops)
    assert same_bits(ep.module()(wq, s, b), reference_dequantize(wq, s, b, spec))
