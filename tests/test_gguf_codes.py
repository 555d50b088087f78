"""llama.cpp's codes kept as stored (mesp/loading/gguf_codes.py): every type's MLX form
dequantizes to `gguf.quants.dequantize`'s values bit for bit, through the native kernel and the
pure-torch path; a GGUF loads with its codes kept (the default), equal to the dense load."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from mesp.loading import load_model
from mesp.loading.gguf import GGUFFile
from mesp.loading.gguf_codes import STORED, stored_bits, to_mlx
from mesp.models.linear import FrozenWeight
from mesp.ops import native
from mesp.quant import QuantSpec, _dequantize_into, dequantize
from tests.test_gguf import ARCHS, write_model

# fp16 fields of each block: (offset) of d, and of dmin / m where the type has one
_F16_AT = {
    QT.Q4_0: (0,),
    QT.Q5_0: (0,),
    QT.Q8_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


def random_blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Any code bytes, with finite fp16 scales (of both signs, some zero, some subnormal)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        d = rng.standard_normal(raw.shape[0]) * rng.choice([1e-6, 1e-3, 0.05, 3.0], raw.shape[0])
        d[:: max(1, raw.shape[0] // 3)] = 0.0
        raw[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _torch_path(wq, s, b, spec):  # type: ignore[no-untyped-def]
    out = torch.empty(wq.shape[0], wq.shape[1] * 32 // spec.bits)
    lib = native.library
    try:
        native.library = lambda: None  # type: ignore[assignment]
        return _dequantize_into(wq, s, b, spec, out)
    finally:
        native.library = lib  # type: ignore[assignment]


@pytest.mark.parametrize("qtype", list(STORED), ids=lambda q: q.name)
@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_every_type_equals_gguf(qtype: QT, blocks: int) -> None:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rows, cols = 7, block * blocks
    raw = random_blocks(qtype, rows, cols, seed=blocks)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    wq, s, b = (torch.from_numpy(a) for a in to_mlx(qtype, raw, (rows, cols)))
    spec = STORED[qtype][0]
    assert wq.dtype == torch.int32 and wq.shape == (rows, cols * spec.bits // 32)
    assert s.shape == b.shape == (rows, cols // spec.group_size)
    assert torch.equal(_torch_path(wq, s, b, spec), want)  # equal values (+0 == -0)
    if native.library() is not None:  # the kernel serves every one of these layouts
        out = torch.empty(rows, cols)
        assert native.dequantize_into(wq, s, b, spec.bits, spec.group_size, out)
        assert torch.equal(out, want)
    assert torch.equal(dequantize(wq, s, b, spec), want)


def test_bits_per_weight() -> None:
    assert stored_bits(QT.Q4_0) == 4.5 and stored_bits(QT.Q4_K) == 4.5
    assert stored_bits(QT.Q6_K) == 6.5625 and stored_bits(QT.Q8_0) == 8.5


def test_group_16_is_6_and_8_bit_only() -> None:
    assert QuantSpec(8, 16).group_size == QuantSpec(6, 16).group_size == 16
    for bits in (4, 5):
        with pytest.raises(Exception, match="group size"):
            QuantSpec(bits, 16)


def test_each_type_keeps_its_width() -> None:
    """5- and 6-bit codes take 5 and 6 bits in memory (not an 8-bit container): the words of a
    row are exactly its codes' bits."""
    widths = {qt: spec.bits for qt, (spec, _) in STORED.items()}
    assert widths == {qt: file_bits for qt, (_, file_bits) in STORED.items()}
    assert STORED[QT.Q5_K][0] == QuantSpec(5, 32) and STORED[QT.Q6_K][0] == QuantSpec(6, 16)
    raw = random_blocks(QT.Q6_K, 3, 512)
    wq, _, _ = to_mlx(QT.Q6_K, raw, (3, 512))
    assert wq.shape == (3, 512 * 6 // 32)


@pytest.mark.parametrize("arch", ARCHS)
def test_load_keeps_codes(tmp_path: Path, arch: str) -> None:
    """Stored (default through ModelOptions) and dense loads give the same weights and logits;
    the quantized leaves keep their codes' layout, float ones stay dense."""
    path = tmp_path / f"{arch}.gguf"
    write_model(path, arch)
    stored = load_model(path, QuantSpec(4, 32), keep_stored=True)
    dense = load_model(path)
    assert stored.base.startswith("llama.cpp's") and "as stored" in stored.base
    mods = dict(dense.model.named_modules())
    kinds = set()
    with GGUFFile(path) as g:
        for name, mod in stored.model.named_modules():
            if not isinstance(mod, FrozenWeight):
                continue
            qt = g.qtype(f"{name}.weight")
            kinds.add(qt)
            assert mod.quant == (STORED[qt][0] if qt in STORED else None), (name, qt)
            assert torch.equal(mod.dense(torch.float32), mods[name].dense(torch.float32)), name
    assert kinds & set(STORED) and kinds - set(STORED)  # codes kept, floats beside them
    ids = torch.arange(12).view(1, -1) % 20
    with torch.no_grad():
        assert torch.equal(stored.model(ids), dense.model(ids))


def test_requantize_says_what_it_costs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, "qwen2")
    with caplog.at_level(logging.WARNING, logger="mesp"):
        loaded = load_model(path, QuantSpec(4, 64))
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "second rounding" in msg and "relative weight error" in msg, msg
    assert loaded.base == ""
    assert any(
        isinstance(m, FrozenWeight) and m.quant == QuantSpec(4, 64) for m in loaded.model.modules()
    )


def test_resume_fingerprint_names_the_base() -> None:
    """`--quantize auto` is 4-bit on an HF source, so a run saved as `--quantize 4` resumes
    under the new default; a GGUF's codes as stored are another base, recorded as such."""
    from types import SimpleNamespace

    from mesp.data import DataConfig
    from mesp.loading.session import ModelOptions
    from mesp.lora import LoraConfig
    from mesp.training.checkpoint import fingerprint
    from mesp.training.config import TrainConfig

    model = SimpleNamespace(config=SimpleNamespace(to_hf=dict))

    def fp(quantize: str, base: str = "") -> object:
        loaded = SimpleNamespace(source="m", model=model, base=base)
        opts = ModelOptions(model="m", quantize=quantize)
        fp = fingerprint(loaded, opts, "mesp", {}, DataConfig(), LoraConfig(), TrainConfig())
        return fp["quantize"]

    assert fp("auto") == fp("4") == "4"
    assert fp("auto", "llama.cpp's Q4_1 x2 (4-bit g32) as stored") == "stored"
    assert fp("none") == "none"


def test_plan_counts_the_stored_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`mesp plan` on a quantized GGUF predicts the weights it will hold as stored, exactly."""
    import json

    from mesp.cli import main

    path = tmp_path / "m.gguf"
    write_model(path, "llama")
    held = sum(
        b.numel() * b.element_size() for b in load_model(path, keep_stored=True).model.buffers()
    )
    assert main(["plan", "--memory", "1GB", "--model", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["quant"] == "as stored"
    assert plan["engines"]["mesp"]["weights"] == held
    assert main(["plan", "--memory", "1GB", "--model", str(path), "--quantize", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quant"] == "4-bit group 64"
