"""`mesp bench dpo` (issue 30 item 6): a DPO step beside SFT on the same tokens, for mesp and
HF + PEFT + gc, end to end through the CLI at a tiny shape: the row's fields, the ratio taken
from the measured peaks, the report section. Nothing is timed against a threshold."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mesp.bench.dpo import TARGET
from mesp.bench.output import load_rows
from mesp.cli.bench import add_parser, run
from mesp.errors import MespError


def _ns(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    return parser.parse_args(argv)


TINY = ["bench", "dpo", "--shapes", "tiny-qwen2", "--seq", "16", "--rank", "4"]
TINY += ["--dtype", "float32", "--steps", "2", "--warmup", "1", "--threads", "1"]


def test_dpo_bench_on_a_tiny_shape(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    md = tmp_path / "B.md"
    assert run(_ns([*TINY, "--out", str(tmp_path), "--markdown", str(md)])) == 0
    (row,) = [r for r in load_rows(tmp_path) if r["table"] == "dpo"]
    c, v = row["config"], row["variants"]
    assert c["tokens_per_step"] == 32 and c["pairs"] == 1 and c["shape"] == "tiny-qwen2"
    assert set(v) == {"mesp-sft", "mesp-dpo", "peft-gc-sft", "peft-gc-dpo"}
    assert "cores" in row["cpu"] and row["command"].startswith("mesp bench dpo --shapes tiny")
    for x in v.values():
        assert x["peak_bytes"] > x["weights_bytes"] > 0
        assert x["over_weights_bytes"] == x["peak_bytes"] - x["weights_bytes"]
        assert len(x["steps_s"]) == 2 and x["tokens_per_s"] == pytest.approx(32 / x["median_s"])
    # the same model, engine and tokens: DPO holds what SFT does plus B-sized buffers and the
    # (B, S) token weights, never less
    dpo, sft = v["mesp-dpo"]["peak_bytes"], v["mesp-sft"]["peak_bytes"]
    assert v["mesp-dpo"]["weights_bytes"] == v["mesp-sft"]["weights_bytes"]
    assert dpo >= sft
    assert row["dpo_over_sft_peak"] == dpo / sft  # from the measured peaks
    for x in ("mesp-sft", "mesp-dpo"):  # the memory model's peak for the same step, within 10%
        assert abs(v[x]["planned_bytes"] / v[x]["peak_bytes"] - 1) <= 0.10, v[x]
    assert row["meets_target"] == (dpo / sft <= TARGET) and row["target"] == TARGET
    assert row["peft_dpo_over_mesp_dpo_peak"] == v["peft-gc-dpo"]["peak_bytes"] / dpo
    # HF's DPO holds full (B, S, V) logits of both passes' log-softmax: above its SFT step
    assert v["peft-gc-dpo"]["peak_bytes"] > v["peft-gc-sft"]["peak_bytes"]
    out = capsys.readouterr().out
    assert "mesp DPO/SFT peak" in out
    report = md.read_text()
    assert "## DPO beside SFT (`mesp bench dpo`)" in report
    assert f"**{dpo / sft:.3f}x**" in report


def test_dpo_bench_refuses_bad_variants(tmp_path: Path) -> None:
    with pytest.raises(MespError, match="mesp-sft and mesp-dpo needed"):
        run(_ns([*TINY, "--engines", "mesp-dpo,peft-gc-dpo", "--out", str(tmp_path)]))
    with pytest.raises(MespError, match="one --shapes"):
        run(_ns([*TINY[:-8], "--seq", "16,32", "--out", str(tmp_path)]))
