"""OLMo 2: what is particular to it beyond the shared oracles (which run on it through
tests/hf_tiny.py's FAMILIES): LoRA gradients of bp, mebp and mesp against HF + PEFT autograd
directly, that both of its pieces (post-branch norms, whole-projection q/k norms) are used, and
the on-device export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mesp.cli import main
from tests.engine_cases import check_engine_against_hf_peft
from tests.hf_tiny import hf_model, mesp_from_hf
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv


@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp"])
def test_lora_grads_equal_hf_peft_autograd(engine: str, tmp_path: Path) -> None:
    """The issue's bar (cos >= 0.999999, rel <= 1e-4) against transformers' own OLMo 2 code."""
    check_engine_against_hf_peft("olmo2", engine, tmp_path)


def test_both_pieces_are_used() -> None:
    """The whole-projection q/k norm couples heads (one RMS per token: scaling head 0 moves
    head 1's output, which a per-head norm would leave alone), and the post-branch norms reach
    the logits (perturbing one moves them)."""
    from mesp.ops.norm import rms_norm, rms_norm_heads

    x = torch.randn(1, 3, 4, 8, generator=torch.Generator().manual_seed(0))
    w = torch.ones(24)
    x2 = x.clone()
    x2[:, 0] *= 3.0
    assert not torch.allclose(rms_norm_heads(x2, w, 1e-6)[:, 1], rms_norm_heads(x, w, 1e-6)[:, 1])
    assert torch.equal(rms_norm(x2, w[:8], 1e-6)[:, 1], rms_norm(x, w[:8], 1e-6)[:, 1])
    ids = torch.randint(0, 211, (1, 9), generator=torch.Generator().manual_seed(2))
    ours = mesp_from_hf(hf_model("olmo2"))
    with torch.no_grad():
        before = ours(ids)
        ours.layers[0].post_feedforward_layernorm.weight.mul_(1.5)
        assert not torch.allclose(ours(ids), before, atol=1e-4)


def test_info_and_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`mesp info` names OLMo 2's norms; `mesp export` writes the on-device programs (they build
    its post-normed blocks: tests/test_ondevice_et.py lowers them with XNNPACK and trains them
    against the engine; here portable kernels, half the lowering time)."""
    base = make_model_dir(tmp_path / "m", "olmo2")
    assert main(["info", "--model", str(base)]) == 0
    assert "norms        after attention and MLP outputs" in capsys.readouterr().out
    ad = tmp_path / "ad"
    data = make_jsonl(tmp_path / "d.jsonl", 4)
    assert main(train_argv(base, data, ad, steps=1, seq_len=32, quantize="none")) == 0
    argv = ["export", "--model", str(base), "--adapter", str(ad), "--out", str(tmp_path / "x")]
    assert main([*argv, "--seq-len", "8", "--portable"]) == 0
    conf = json.loads((tmp_path / "x" / "run_config.json").read_text())
    assert conf["model"]["family"] == "olmo2"
