"""Gemma 2 beyond the shared oracles (which run on it through tests/hf_tiny.py's FAMILIES):
LoRA gradients of bp, mebp and mesp against HF + PEFT autograd directly, both soft-caps on, at a
sequence (23) longer than the window (5); the on-device export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesp.cli import main
from mesp.engines import make_engine
from tests.engine_cases import (
    assert_grads_match,
    check_engine_against_hf_peft,
    grads_of,
    padded_batch,
)
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv


@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp"])
def test_lora_grads_equal_hf_peft_autograd(engine: str, tmp_path: Path) -> None:
    """The issue's bar (cos >= 0.999999, rel <= 1e-4) against transformers' Gemma 2 (eager
    attention: the soft-capped one)."""
    check_engine_against_hf_peft("gemma2", engine, tmp_path)


def test_info_and_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`mesp info` names both caps; `mesp export` writes the on-device programs (their
    attention carries the cap: tests/test_ondevice_et.py lowers them with XNNPACK and trains
    them against the engine; here portable kernels, half the lowering time)."""
    base = make_model_dir(tmp_path / "m", "gemma2")
    assert main(["info", "--model", str(base)]) == 0
    assert "soft-caps    attention 0.05, logits 0.3" in capsys.readouterr().out
    ad = tmp_path / "ad"
    data = make_jsonl(tmp_path / "d.jsonl", 4)
    assert main(train_argv(base, data, ad, steps=1, seq_len=32, quantize="none")) == 0
    argv = ["export", "--model", str(base), "--adapter", str(ad), "--out", str(tmp_path / "x")]
    assert main([*argv, "--seq-len", "8", "--portable"]) == 0
    conf = json.loads((tmp_path / "x" / "run_config.json").read_text())
    assert conf["model"]["family"] == "gemma2"


def test_sampled_softmax_and_logits_masking_under_both_caps() -> None:
    """The loss-head options with Gemma 2's final cap (and the attention cap upstream): logits
    masking off gives the same gradients, and the sampled softmax is the same objective in
    mebp and mesp as in bp."""
    from mesp.engines.loss import LossSpec
    from tests.engine_cases import model_with_adapter

    model, batch = model_with_adapter("gemma2"), padded_batch()
    on = grads_of(make_engine("mesp", loss=LossSpec(mask_logits=True)), model, batch)
    off = grads_of(make_engine("mesp", loss=LossSpec(mask_logits=False)), model, batch)
    assert on[0] == pytest.approx(off[0], rel=1e-6)
    assert_grads_match(on[1], off[1])
    sampled = LossSpec("sampled-softmax", vocab_subset=40, seed=3)
    ref_loss, ref = grads_of(make_engine("bp", loss=sampled), model, batch)
    for name in ("mebp", "mesp"):
        loss, g = grads_of(make_engine(name, loss=sampled), model, batch)
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert_grads_match(ref, g)
