"""k-quant GGUF export: mesp's Q4_K / Q5_K / Q6_K block quantizers, decoded by gguf-py (whose
own `quantize` has none of the three, so its `dequantize` is the independent reader), and
`mesp merge --gguf-type q4_k_m|q5_k_m|q6_k` with llama-quantize's per-tensor type mix.

The error bounds, relative RMS error for N(0, s^2) weights: rounding to a grid of step h errs by
h/sqrt(12) on average. Q4_K fits each 32-weight sub-block's range, about 4.14 s (twice the
expected maximum of 32 normals), with 15 steps: 0.080 s; Q5_K with 31 steps: 0.0385 s; Q6_K maps
each 16-weight sub-block's largest |x| (about 2.07 s) to 32 steps: 0.0187 s. The fitted grids do
better than these first guesses (measured: 0.072, 0.036, 0.0178), so they are the bounds.
Beyond the bounds, the bytes are ggml's own: known answers from its reference quantizers.
The type mix is checked rule by rule here and, in the slow suite, against every tensor of a
Q4_K_M file llama-quantize wrote.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from mesp.convert.gguf_kquant import quantize_k
from mesp.convert.gguf_mix import mix_type, use_more_bits
from tests.test_gguf_export import _base, _fails, _merge, _transformers_logits

BOUND = {QT.Q4_K: 0.080, QT.Q5_K: 0.0385, QT.Q6_K: 0.0187}
KTYPES = tuple(BOUND)


def _rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def _roundtrip(w: np.ndarray, qt: QT) -> np.ndarray:
    data = quantize_k(w, qt)
    rows, cols = w.shape
    block, size = gguf.GGML_QUANT_SIZES[qt]
    assert data.dtype == np.uint8 and data.shape == (rows, cols // block * size)
    return gguf.quants.dequantize(data, qt).reshape(w.shape)


@pytest.mark.parametrize("qt", KTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(64, 256), (32, 512), (16, 1024)])
def test_random_weights_decode_within_the_types_bound(qt: QT, shape: tuple[int, int]) -> None:
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 0.02
    assert _rel_rms(_roundtrip(w, qt), w) < BOUND[qt]


@pytest.mark.parametrize("qt", KTYPES, ids=lambda q: q.name)
def test_llama_cpp_acceptance_data(qt: QT) -> None:
    """llama.cpp's test-quantize-fns: 4096 values 0.1 + 2 cos(i), error sqrt(sum d^2) / n
    under 0.002 for every one of these types."""
    x = (0.1 + 2 * np.cos(np.arange(4096, dtype=np.float32))).astype(np.float32)[None]
    err = math.sqrt(float(np.sum((_roundtrip(x, qt) - x).astype(np.float64) ** 2))) / x.size
    assert err < 0.002


@pytest.mark.parametrize("qt", KTYPES, ids=lambda q: q.name)
def test_zero_blocks_outliers_and_constant_sub_blocks(qt: QT) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 512)).astype(np.float32) * 0.02
    w[0, :256] = 0  # a whole super-block
    w[1, 32:64] = 0  # a sub-block (and, for Q6_K, two) inside a live one
    w[2, 64:96] = -0.01  # a constant negative sub-block
    w[3, 300] = 1.0  # a 50-sigma outlier in the second super-block
    back = _roundtrip(w, qt)
    data = quantize_k(w, qt)
    assert not data[0, : gguf.GGML_QUANT_SIZES[qt][1]].any()  # all zero bytes, as llama.cpp's
    assert not back[0, :256].any() and not back[1, 32:64].any()
    # the constant: Q4_K/Q5_K store it as the sub-block's min, a 6-bit multiple of dmin (the
    # largest min / 63), Q6_K as its scale, an 8-bit multiple of the largest / 128, times -32:
    # either way within half a step of a grid of the super-block's largest |x| / 63
    peak = np.abs(w[2, :256]).max()
    np.testing.assert_allclose(back[2, 64:96], -0.01, rtol=0, atol=peak / 126)
    step = 1.0 / (15 if qt == QT.Q4_K else 31 if qt == QT.Q5_K else 32)
    assert abs(back[3, 300] - 1.0) <= step  # within a step of its own grid
    live = np.ones_like(w, bool)
    live[0, :256] = live[1, 32:64] = live[2, 64:96] = False
    live[3, 256:] = False  # the outlier's super-block pays for it: coarser sub-block scales
    assert _rel_rms(back[live], w[live]) < BOUND[qt] * 1.05


def _kat_input() -> np.ndarray:
    """32 rows of 512, the same on every platform (an integer hash, sums of four uniforms
    exact in float64, one rounding to float32), with the edge cases above."""
    i = np.arange(32 * 512 * 4, dtype=np.uint64)
    u = ((i * np.uint64(2654435761)) % np.uint64(2**32)).astype(np.float64) / 2**32
    x = ((u.reshape(-1, 4).sum(1) - 2.0) * 0.05).astype(np.float32).reshape(32, 512)
    x[0, :256] = 0
    x[1, 32:64] = 0
    x[2, 64:96] = -0.01
    x[3, 300] = 1.0
    x[4] += 0.3  # all positive: the fitted min is clamped to 0
    x[5] -= 0.3  # all negative
    return x


# sha256 of ggml's own quantize_row_q{4,5,6}_K_ref output for _kat_input(): ggml-org/ggml
# d99724f2 src/ggml-quants.c built with gcc -O2 for x86-64 (no FMA contraction), called through
# ctypes. mesp's float32 operations and sums run in the C code's order, so the bytes are equal.
KAT = {
    QT.Q4_K: "96454843d4847762a6ec36c2212bc183965d99b9407c6ebfed59c0eb002816cd",
    QT.Q5_K: "bfeaac85c3ac34553afd813ff6ec9b4182e7a83750b5b618ce32b23bb5ef5b69",
    QT.Q6_K: "346be1ecb6ba35ea8825fc3dcd9d1fb1d05cdea34f4da11c8551edd0feb12c60",
}


@pytest.mark.parametrize("qt", KTYPES, ids=lambda q: q.name)
def test_bytes_equal_ggmls_reference_quantizer(qt: QT) -> None:
    data = quantize_k(_kat_input(), qt)
    assert hashlib.sha256(data.tobytes()).hexdigest() == KAT[qt]


def test_type_mix_follows_llama_quantize() -> None:
    # llama.cpp's layers with more bits, for 8 layers: the first and last eighth, every third
    assert [use_more_bits(i, 8) for i in range(8)] == [1, 0, 0, 1, 0, 0, 1, 1]
    cases = [  # (name, HF shape (rows, cols), mix, tied, type)
        ("blk.1.attn_q.weight", (512, 512), "q4_k_m", False, QT.Q4_K),
        ("blk.0.attn_v.weight", (256, 512), "q4_k_m", False, QT.Q6_K),
        ("blk.1.attn_v.weight", (256, 512), "q4_k_m", False, QT.Q4_K),
        ("blk.3.ffn_down.weight", (512, 1024), "q5_k_m", False, QT.Q6_K),
        ("blk.4.ffn_down.weight", (512, 1024), "q5_k_m", False, QT.Q5_K),
        ("blk.0.ffn_down.weight", (512, 1024), "q6_k", False, QT.Q6_K),
        ("output.weight", (300, 512), "q4_k_m", False, QT.Q6_K),
        ("output.weight", (300, 576), "q4_k_m", False, QT.Q8_0),  # 576 % 256: Q8_0
        ("token_embd.weight", (300, 512), "q4_k_m", False, QT.Q4_K),  # untied: the default
        ("token_embd.weight", (300, 512), "q5_k_m", True, QT.Q6_K),  # tied: as output
        ("token_embd.weight", (300, 576), "q5_k_m", True, QT.Q8_0),
        # the fallback when 256 does not divide the row: Q5_0, Q5_1, Q8_0, then F16
        ("blk.1.attn_q.weight", (576, 576), "q4_k_m", False, QT.Q5_0),
        ("blk.1.attn_q.weight", (576, 576), "q5_k_m", False, QT.Q5_1),
        ("blk.1.attn_q.weight", (576, 576), "q6_k", False, QT.Q8_0),
        ("blk.0.attn_v.weight", (576, 576), "q4_k_m", False, QT.Q8_0),  # Q6_K's fallback
        ("blk.1.attn_q.weight", (72, 72), "q4_k_m", False, QT.F16),
        ("output.weight", (300, 72), "q6_k", False, QT.F16),
        ("blk.1.attn_norm.weight", (512,), "q4_k_m", False, QT.F32),
        ("blk.1.attn_q.bias", (512,), "q4_k_m", False, QT.F32),
    ]
    for name, shape, mix, tied, want in cases:
        assert mix_type(name, shape, mix, 8, tied) == want, (name, shape, mix)


K256 = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
K256 |= {"head_dim": 64, "intermediate_size": 512, "num_hidden_layers": 3}


def _decoded(path: Path) -> dict[str, tuple[QT, np.ndarray]]:
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(reversed([int(n) for n in t.shape]))
        out[t.name] = (t.tensor_type, gguf.quants.dequantize(np.array(t.data), t.tensor_type))
        out[t.name] = (out[t.name][0], out[t.name][1].reshape(shape))
    return out


@pytest.mark.parametrize(
    ("family", "mix", "more"),
    [  # more: the tensors that differ from the mix's own type (3 layers: layer 2 gets more bits)
        ("llama", "q4_k_m", {"blk.2.attn_v.weight", "blk.2.ffn_down.weight", "output.weight"}),
        ("qwen2", "q5_k_m", {"blk.2.attn_v.weight", "blk.2.ffn_down.weight", "token_embd.weight"}),
        ("qwen2", "q6_k", set()),
    ],
)
def test_k_quant_merge_reads_in_transformers(
    family: str, mix: str, more: set[str], tmp_path: Path
) -> None:
    base = _base(tmp_path, family, **K256)  # rows of 256 and 512: every weight a k-quant
    exact = _decoded(_merge(base, tmp_path, "f32.gguf", "--gguf-type", "f32"))
    out = _merge(base, tmp_path, f"{mix}.gguf", "--gguf-type", mix)
    own = {"q4_k_m": QT.Q4_K, "q5_k_m": QT.Q5_K, "q6_k": QT.Q6_K}[mix]
    reader = gguf.GGUFReader(out)
    ftype = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}[mix]  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
    assert reader.fields["general.file_type"].contents() == ftype
    got = _decoded(out)
    assert got.keys() == exact.keys()
    for name, (qt, w) in got.items():
        want = exact[name][1]
        if want.ndim == 1 or name.endswith("_norm.weight"):
            assert qt == QT.F32 and np.array_equal(w, want), name
            continue
        assert qt == (QT.Q6_K if name in more else own), name
        assert _rel_rms(w, want) < BOUND[qt], name  # merged weights are near-normal
    ref = _transformers_logits(tmp_path / "f32.gguf")
    err = float(
        (_transformers_logits(out) - ref).square().mean().sqrt() / ref.square().mean().sqrt()
    )
    # this random model turns a weight error e into a logit error ~5 e (Gaussian noise of the
    # same size does the same): the tolerance is 7x the file's worst weight bound
    assert err < 7 * max(BOUND[own], BOUND[QT.Q6_K])
    _reads_back_as_stored(out, got)
    q4_0 = _merge(base, tmp_path, "q4_0.gguf", "--gguf-type", "q4_0")
    worse = (_transformers_logits(q4_0) - ref).square().mean().sqrt() / ref.square().mean().sqrt()
    assert err < float(worse)  # and every mix beats plain Q4_0, as llama.cpp's do


def _reads_back_as_stored(path: Path, decoded: dict[str, tuple[QT, np.ndarray]]) -> None:
    """mesp trains the file it wrote on its codes as stored: each weight equals gguf's decoding
    (llama's q/k rows in HF order: GGUFFile.tensor undoes the converter's permutation)."""
    from mesp.loading import load_model
    from mesp.loading.gguf import GGUFFile
    from mesp.models.linear import FrozenWeight

    model = load_model(path, keep_stored=True).model
    with GGUFFile(path) as g:
        for name, mod in model.named_modules():
            if isinstance(mod, FrozenWeight) and g.qtype(f"{name}.weight") != QT.F32:
                assert mod.quant is not None, name
                assert torch.equal(mod.dense(torch.float32), g.tensor(f"{name}.weight")), name
    assert len({qt for qt, _ in decoded.values()} - {QT.F32}) >= 1


def test_unknown_type_lists_the_k_quants(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = _base(tmp_path, "qwen2")
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad")]
    _fails([*argv, "--out", str(tmp_path / "m.gguf"), "--gguf-type", "q4_k"], capsys, "q4_k_m")


@pytest.mark.real_model
def test_type_mix_is_the_real_q4_k_m_files() -> None:
    """Gemma 3 270M Q4_K_M as llama-quantize wrote it: rows of 640 (not a multiple of 256),
    1024 and 2048, tied embeddings, 18 layers; every tensor's type is the one mix_type gives."""
    from tests.test_real_gguf import _gemma3

    reader = gguf.GGUFReader(_gemma3())
    assert reader.fields["general.file_type"].contents() == 15  # MOSTLY_Q4_K_M
    n_layer = int(reader.fields["gemma3.block_count"].contents())
    tied = "output.weight" not in {t.name for t in reader.tensors}
    got = {}
    for t in reader.tensors:
        shape = tuple(reversed([int(n) for n in t.shape]))
        got[t.name] = (t.tensor_type, mix_type(t.name, shape, "q4_k_m", n_layer, tied))
    assert {name for name, (real, ours) in got.items() if real != ours} == set()
    # all five kinds occur, so the file exercises every rule above
    assert {real for real, _ in got.values()} == {QT.F32, QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0}
