"""`mesp merge`: the merged directory loads in mesp and in transformers and gives the logits of
base + adapter; quantized, it is an MLX-layout directory that loads back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesp.cli import main
from mesp.convert.merge import merge_into_base
from mesp.loading import load_model
from mesp.loading.tokenizer import Tokenizer
from mesp.lora import LoraConfig, apply_lora, load_adapter, save_adapter
from mesp.quant import QuantSpec
from tests.tiny_dir import make_model_dir

IDS = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(5))
WIDE = {"hidden_size": 128, "num_attention_heads": 4, "head_dim": 32, "intermediate_size": 256}


def _adapter(model_dir: Path, out: Path) -> None:
    """A rank-2 adapter with non-zero A and B (a fresh one would merge to the base)."""
    model = load_model(model_dir).model
    cfg = LoraConfig(rank=2, alpha=8.0)
    apply_lora(model, cfg, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.lora_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_adapter(model, out, cfg)


@pytest.mark.parametrize(
    "family", ["qwen2", "llama", "gemma3", "mistral", "smollm3", "granite", "olmo2", "gemma2"]
)
def test_merged_dir_equals_base_plus_adapter_in_mesp_and_transformers(
    family: str, tmp_path: Path
) -> None:
    import transformers

    base = make_model_dir(tmp_path / "base", family)
    _adapter(base, tmp_path / "ad")
    out = tmp_path / "merged"
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out", str(out)]
    assert main(argv) == 0
    with_adapter = load_model(base).model
    load_adapter(with_adapter, tmp_path / "ad")
    merged = load_model(out)
    assert merged.fmt == "hf" and not merged.model.lora_modules()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        want = with_adapter(IDS)
        torch.testing.assert_close(merged.model(IDS), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(hf(IDS).logits, want, atol=1e-4, rtol=0)
    a, b = Tokenizer.from_dir(base), merged.tokenizer
    assert b is not None and b.encode("To be, or not") == a.encode("To be, or not")
    assert (b.eos_id, b.chat_template) == (a.eos_id, a.chat_template)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "smollm3", "granite", "olmo2", "gemma2"])
def test_quantized_merge_is_an_mlx_dir_that_loads_bit_exact(family: str, tmp_path: Path) -> None:
    base = make_model_dir(tmp_path / "base", family, **WIDE)
    _adapter(base, tmp_path / "ad")
    out = tmp_path / "merged4"
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out", str(out)]
    assert main([*argv, "--quantize", "4", "--group-size", "64"]) == 0
    q = QuantSpec(4, 64)
    ref = load_model(base).model
    load_adapter(ref, tmp_path / "ad")
    merge_into_base(ref, q)
    loaded = load_model(out)
    assert loaded.fmt == "mlx" and loaded.model.layers[0].mlp.up_proj.quant == q
    with torch.no_grad():
        assert torch.equal(loaded.model(IDS), ref(IDS))


def test_merge_refuses_to_write_over_its_base(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = make_model_dir(tmp_path / "base", "qwen2")
    _adapter(base, tmp_path / "ad")
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out", str(base)]
    assert main(argv) == 2
    assert "base model's directory" in capsys.readouterr().err
