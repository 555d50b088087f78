"""Tests for mesp.quant: MLX-layout affine quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mesp import quant, quant_pack
from mesp.errors import MespError
from mesp.quant import (
    QuantSpec,
    dequantize,
    dequantize_core_aten,
    dequantize_gather,
    dequantize_rows,
    from_uint32,
    packed_bytes,
    quantize,
    quantized_bytes,
    to_uint32,
)

SPECS = [QuantSpec(b, g) for b in (4, 5, 6, 8) for g in (32, 64, 128)]
MLX_SPECS = list(SPECS)  # MLX's own group sizes; 16 is GGUF's Q6_K's, mesp's alone
SPECS += [QuantSpec(6, 16), QuantSpec(8, 16)]


def stream_values(wq: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout spelled out, independently of mesp.quant_pack: each row's bytes as one
    little-endian bit array (numpy), value j = its bits bits·j .. bits·j + bits − 1."""
    raw = to_uint32(wq).numpy().astype("<u4").view(np.uint8).reshape(wq.shape[0], -1)
    b = np.unpackbits(raw, axis=-1, bitorder="little").reshape(wq.shape[0], -1, bits)
    return torch.from_numpy((b.astype(np.int64) << np.arange(bits)).sum(-1))


def _weight(out_f: int, in_f: int, gs: int, seed: int = 0) -> torch.Tensor:
    """Random weight with edge-case groups: all zero, constant, huge outlier, all negative."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    w[0, :gs] = 0.0
    w[1, :gs] = 0.3
    w[2, :gs] = -0.7
    w[3, 5] = 40.0
    w[4, 7] = -40.0
    w[5, :gs] = -torch.rand(gs, generator=gen)
    w[6, :gs] = 1e-9
    return w


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error(spec: QuantSpec, dtype: torch.dtype) -> None:
    gs, n_bins = spec.group_size, 2**spec.bits - 1
    w = _weight(72, 3 * 128, gs).to(dtype)
    wq, s, b = quantize(w, spec)
    assert wq.dtype == torch.int32 and wq.shape == (72, 3 * 128 * spec.bits // 32)
    assert s.dtype == b.dtype == dtype and s.shape == b.shape == (72, 3 * 128 // gs)
    d = dequantize(wq, s, b, spec, torch.float32).view(72, -1, gs)
    err = (w.float().view(72, -1, gs) - d).abs()
    s32, b32 = s.float().abs().unsqueeze(-1), b.float().abs().unsqueeze(-1)
    w_max = w.float().view(72, -1, gs).abs().amax(-1, keepdim=True)
    # Rounding slack: scale, bias (stored in dtype) and the result each round once.
    tiny = torch.finfo(dtype).eps * (b32 + n_bins * s32 + w_max) + 1e-12
    q = quant_pack.unpack_values(wq, spec.bits, torch.float32).view(72, -1, gs)
    assert torch.equal(q.view(72, -1).long(), stream_values(wq, spec.bits))
    # Unclamped values round to nearest; MLX fits the scale to the larger-magnitude end, so the
    # other end may land one step past n_bins and is clamped: at most one scale away.
    assert bool((err[q < n_bins] <= (s32 / 2 + tiny).expand_as(err)[q < n_bins]).all())
    assert bool((err <= s32 + tiny).all())
    assert torch.equal(d[0, 0], torch.zeros(gs)) and torch.equal(d[1, 0], w[1, :gs].float())


def test_packing_layout_hand_made() -> None:
    spec4 = QuantSpec(4, 32)
    # q = w + 15 (scale 1, bias -15): word 0 holds values 0..7, lowest nibble first.
    w = torch.tensor([list(range(16)) * 2], dtype=torch.float32) - 15
    wq, s, b = quantize(w, spec4)
    assert s.item() == 1.0 and b.item() == -15.0
    assert to_uint32(wq)[0].tolist() == [0x76543210, 0xFEDCBA98] * 2
    assert wq[0, 1].item() == 0xFEDCBA98 - 2**32
    q8 = torch.arange(32.0) * 8
    q8[-1] = 255
    wq8, s8, b8 = quantize(q8.view(1, 32) - 255, QuantSpec(8, 32))
    assert s8.item() == 1.0 and b8.item() == -255.0
    assert to_uint32(wq8)[0, 0].item() == 0x18100800  # bytes 0, 8, 16, 24
    hand = torch.tensor([[0x76543210, 0x0F0F0F0F, 0x1, 0x0]], dtype=torch.uint32)
    d = dequantize(from_uint32(hand), torch.ones(1, 1), torch.zeros(1, 1), spec4)
    assert d[0].tolist() == list(range(8)) + [15, 0] * 4 + [1] + [0] * 15


def test_five_and_six_bit_layout_hand_made() -> None:
    """5 bits: 8 values fill 5 bytes, value 1 straddles bytes 0 and 1; 6 bits: 4 values fill 3
    bytes; a value straddles a word boundary too (5 bits: value 6 of a row at bits 30..34)."""
    q5 = torch.tensor([[31, 1, 0, 0, 0, 0, 0b10111, 0] + [0] * 24])
    wq5 = quant_pack.pack(q5, 5)
    assert wq5.shape == (1, 5)
    # bits 0-4: 31; bits 5-9: 1 (bit 5); bits 30-34: 0b10111 -> bits 30, 31 of word 0, 32, 34
    assert to_uint32(wq5)[0].tolist() == [0x1F | 1 << 5 | 0b11 << 30, 0b101, 0, 0, 0]
    q6 = torch.tensor([[63, 2, 0, 33] + [0] * 12])
    wq6 = quant_pack.pack(q6, 6)
    assert to_uint32(wq6)[0].tolist() == [63 | 2 << 6 | 33 << 18, 0, 0]
    for wq, q, bits in ((wq5, q5, 5), (wq6, q6, 6)):
        assert torch.equal(stream_values(wq, bits), q)
        assert torch.equal(quant_pack.unpack_values(wq, bits, torch.int64), q)
    spec = QuantSpec(6, 16)
    d = dequantize(wq6, torch.full((1, 1), 0.5), torch.full((1, 1), -1.0), spec)
    assert d[0, :4].tolist() == [30.5, 0.0, -1.0, 15.5]


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_byte_unpack_equals_shift_unpack(bits: int) -> None:
    words = torch.randint(-(2**31), 2**31 - 1, (5, 30), dtype=torch.int32)
    ref = quant_pack.unpack_shift(words, bits, torch.float32)
    assert ref.shape == (5, 30 * 32 // bits) and int(ref.max()) <= 2**bits - 1
    assert torch.equal(ref.long(), stream_values(words, bits))
    assert torch.equal(quant_pack.unpack_values(words, bits, torch.float32), ref)
    edge = quant_pack.unpack_bytes_core_aten(packed_bytes(words), bits, torch.bfloat16)
    assert torch.equal(edge.float(), ref)
    assert torch.equal(quant_pack.pack(ref.long(), bits), words)  # pack is its inverse
    # a non-contiguous column slice: words bits, 3·bits hold values 32 .. 96 at every width
    got = quant_pack.unpack_values(words[:, bits : 3 * bits], bits, torch.float32)
    assert torch.equal(got, ref[:, 32:96])


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_core_aten_dequantize_is_the_same_bits(spec: QuantSpec) -> None:
    w = _weight(24, 256, spec.group_size, seed=spec.bits)
    for dtype in (torch.float32, torch.bfloat16):
        wq, s, b = quantize(w.to(dtype), spec)
        want = dequantize(wq, s, b, spec)
        assert torch.equal(dequantize_core_aten(packed_bytes(wq), s, b, spec), want)


@pytest.mark.parametrize("spec", MLX_SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_mlx_bit_for_bit(spec: QuantSpec, dtype: torch.dtype) -> None:
    mx = pytest.importorskip("mlx.core")
    mx_dtype = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    w = _weight(72, 4 * 128, spec.group_size, seed=spec.bits + spec.group_size).to(dtype)
    w[7] = torch.linspace(-3, 1, w.shape[1])
    w_mx = mx.array(w.float().numpy()).astype(mx_dtype[dtype])
    mq, ms, mb = mx.quantize(w_mx, group_size=spec.group_size, bits=spec.bits)

    def back(a: object) -> torch.Tensor:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(dtype)  # type: ignore[attr-defined]

    wq, s, b = quantize(w, spec)
    assert torch.equal(to_uint32(wq), torch.from_numpy(np.array(mq)))
    assert torch.equal(s, back(ms)) and torch.equal(b, back(mb))
    assert torch.equal(s.signbit(), back(ms).signbit())
    md = mx.dequantize(mq, ms, mb, group_size=spec.group_size, bits=spec.bits)
    assert torch.equal(dequantize(wq, s, b, spec), back(md))


def test_quantize_in_row_blocks_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = QuantSpec(4, 32)
    w = _weight(37, 128, 32).to(torch.bfloat16)
    whole = quantize(w, spec)
    monkeypatch.setattr(quant, "_CHUNK", 5 * 128)  # blocks of 5 rows, the last one partial
    for a, b in zip(quantize(w, spec), whole, strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert all(t.shape[0] == 0 for t in quantize(torch.zeros(0, 64), spec))


@pytest.mark.parametrize("spec", [QuantSpec(4, 32), QuantSpec(8, 64)], ids=str)
def test_rows_and_gather_match_full(spec: QuantSpec) -> None:
    w = _weight(40, 256, spec.group_size).to(torch.bfloat16)
    qs = quantize(w, spec)
    full = dequantize(*qs, spec)
    assert torch.equal(dequantize_rows(*qs, spec, 3, 17), full[3:17])
    assert dequantize_rows(*qs, spec, 5, 5).shape == (0, 256)
    assert dequantize_rows(*qs, spec, 0, 40, torch.float32).dtype == torch.float32
    ids = torch.tensor([[0, 39, 7], [7, 2, 1]])
    assert torch.equal(dequantize_gather(*qs, spec, ids), full[ids])
    assert torch.equal(dequantize_gather(*qs, spec, ids.int()[0]), full[ids[0]])
    assert dequantize_gather(*qs, spec, torch.zeros(0, dtype=torch.long)).shape == (0, 256)


def test_uint32_round_trip_through_safetensors(tmp_path: object) -> None:
    st = pytest.importorskip("safetensors.torch")
    wq, _, _ = quantize(torch.randn(8, 64), QuantSpec(4, 64))
    path = f"{tmp_path}/q.safetensors"
    st.save_file({"wq": to_uint32(wq)}, path)
    loaded = st.load_file(path)["wq"]
    assert loaded.dtype == torch.uint32 and torch.equal(from_uint32(loaded), wq)


def test_quantized_bytes() -> None:
    assert quantized_bytes(896, 4864, QuantSpec(4, 64), torch.bfloat16) == (
        896 * 4864 // 2 + 2 * 896 * 76 * 2
    )
    assert quantized_bytes(128, 896, QuantSpec(8, 128), torch.float32) == 128 * 896 + 7168
    assert quantized_bytes(896, 4864, QuantSpec(5, 32), torch.float32) == (
        896 * 4864 * 5 // 8 + 2 * 896 * 152 * 4
    )
    assert quantized_bytes(2, 256, QuantSpec(6, 16), torch.float32) == 2 * 192 + 2 * 2 * 16 * 4
    for spec in (QuantSpec(5, 32), QuantSpec(6, 16)):
        wq, s, b = quantize(torch.randn(16, 256), spec)
        nbytes = sum(t.numel() * t.element_size() for t in (wq, s, b))
        assert quantized_bytes(16, 256, spec, torch.float32) == nbytes
    wq, s, b = quantize(torch.randn(16, 128), QuantSpec(4, 32))
    nbytes = sum(t.numel() * t.element_size() for t in (wq, s, b))
    assert quantized_bytes(16, 128, QuantSpec(4, 32), torch.float32) == nbytes


@pytest.mark.parametrize(
    "bits, gs", [(3, 64), (7, 32), (16, 64), (4, 16), (5, 16), (6, 8), (4, 256), (4.0, 64)]
)
def test_bad_spec(bits: int, gs: int) -> None:
    with pytest.raises(MespError):
        QuantSpec(bits, gs)


def test_error_cases() -> None:
    spec = QuantSpec(4, 64)
    with pytest.raises(MespError, match="multiple"):
        quantize(torch.randn(4, 96), spec)
    with pytest.raises(MespError):
        quantize(torch.randn(64), spec)
    with pytest.raises(MespError):
        quantize(torch.ones(2, 64, dtype=torch.int32), spec)
    with pytest.raises(MespError, match="NaN"):
        quantize(torch.full((2, 64), float("nan")), spec)
    with pytest.raises(MespError):
        quantized_bytes(4, 96, spec, torch.float32)
    wq, s, b = quantize(torch.randn(4, 128), spec)
    with pytest.raises(MespError, match="disagree"):
        dequantize(wq, s[:, :1], b, spec)
    with pytest.raises(MespError, match="disagree"):
        dequantize(wq, s, b, QuantSpec(8, 64))
    with pytest.raises(MespError):
        dequantize(wq.float(), s, b, spec)
    with pytest.raises(MespError):
        dequantize(wq, s, b, spec, torch.int32)
    with pytest.raises(MespError):
        dequantize_rows(wq, s, b, spec, 3, 5)
    with pytest.raises(MespError):
        dequantize_gather(wq, s, b, spec, torch.tensor([4]))
    with pytest.raises(MespError):
        dequantize_gather(wq, s, b, spec, torch.tensor([0.0]))
    with pytest.raises(MespError):
        to_uint32(wq.long())
    with pytest.raises(MespError):
        from_uint32(wq.float())
