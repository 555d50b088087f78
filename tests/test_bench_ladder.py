"""`mesp bench ladder`: every rung's exact peak on the meta device equals the CPU run's, so the
ladder's 3B / 16k-token figures (measured on meta) are what the arithmetic would hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesp.bench.child import measure
from mesp.bench.ladder import RUNGS, LadderOptions, ladder_configs
from mesp.cli import main
from mesp.models.transformer import MLP


def test_meta_peak_equals_cpu_peak_on_every_rung(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MLP, "tile", 16)  # 48 tokens: the tiled MLP path is in play too
    seq = 48
    by_dev = {
        dev: ladder_configs(LadderOptions(shape="tiny-qwen2", seqs=(seq,), device=dev))
        for dev in ("cpu", "meta")
    }
    assert [c.variant for c in by_dev["cpu"]] == [k for k, _, _ in RUNGS]
    totals = {}
    for cpu_c, meta_c in zip(by_dev["cpu"], by_dev["meta"], strict=True):
        cpu_c.steps = 1
        cpu, meta = measure(cpu_c)["exact"], measure(meta_c)["exact"]
        # equal up to the host copies of the index vectors a meta run needs (int64 per token)
        assert abs(cpu["total"] - meta["total"]) <= 24 * seq, (cpu_c.variant, cpu, meta)
        totals[cpu_c.variant] = cpu["total"]
    # each rung below the one before, except where a technique does not apply at this size
    assert totals["4bit"] < totals["lora"] and totals["mebp"] < totals["4bit"]
    assert totals["stream"] < totals["offload"] < totals["mebp"]


def test_cli_ladder_writes_rows_report_and_plot(tmp_path: Path) -> None:
    out, md = tmp_path / "out", tmp_path / "B.md"
    argv = ["bench", "ladder", "--shapes", "tiny-qwen2", "--seq", "32", "--rungs", "lora,stream"]
    assert main([*argv, "--out", str(out), "--markdown", str(md)]) == 0
    assert len(list((out / "rows" / "ladder").glob("*.json"))) == 2
    text = md.read_text()
    assert "peak-memory ladder" in text and "+ weight streaming" in text
    assert (out / "ladder.png").stat().st_size > 1000
    assert main([*argv, "--rungs", "nope", "--out", str(out)]) == 2


def test_cli_softmax_trains_both_losses_and_reports(tmp_path: Path) -> None:
    """The harness on a tiny checkpoint (the real-model figures come from the same command)."""
    from tests.tiny_dir import make_model_dir

    model = make_model_dir(tmp_path / "tiny", "qwen2")
    out, md = tmp_path / "out", tmp_path / "B.md"
    argv = ["bench", "softmax", "--models", str(model), "--train-steps", "3", "--seq", "32"]
    assert main([*argv, "--vocab-subset", "20", "--out", str(out), "--markdown", str(md)]) == 0
    rows = sorted((out / "rows" / "softmax").glob("*.json"))
    assert len(rows) == 2
    text = md.read_text()
    assert "Sampled softmax" in text and "| sampled-softmax |" in text and "| ce |" in text
