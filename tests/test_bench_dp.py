"""`mesp bench dp` (issue 38 item 6): a DP-SGD step (per-layer, flat) beside SFT on the same rows,
mesp and HF + PEFT + Opacus, end to end through the CLI at a tiny shape: the row's fields, the
ratios taken from the measured peaks and times, the report section. Nothing is timed against a
threshold."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mesp.bench.dp import TARGETS
from mesp.bench.output import load_rows
from mesp.cli.bench import add_parser, run
from mesp.errors import MespError

pytest.importorskip("opacus")


def _ns(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    return parser.parse_args(argv)


TINY = ["bench", "dp", "--shapes", "tiny-qwen2", "--seq", "16", "--rank", "4", "--batch", "3"]
TINY += ["--dtype", "float32", "--steps", "2", "--warmup", "1", "--threads", "1"]


def test_dp_bench_on_a_tiny_shape(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    md = tmp_path / "B.md"
    assert run(_ns([*TINY, "--out", str(tmp_path), "--markdown", str(md)])) == 0
    (row,) = [r for r in load_rows(tmp_path) if r["table"] == "dp"]
    c, v, x = row["config"], row["variants"], row["over_sft"]
    assert c["batch"] == 3 and c["seq"] == 16 and c["shape"] == "tiny-qwen2"
    assert set(v) == {"mesp-sft", "mesp-dp-layer", "mesp-dp-flat", "peft-opacus"}
    assert row["command"].startswith("mesp bench dp --shapes tiny-qwen2")
    assert "--batch 3" in row["command"]
    for n, p in v.items():
        assert p["peak_bytes"] > p["weights_bytes"] > 0
        assert len(p["steps_s"]) == 2 and p["tokens_per_s"] == pytest.approx(48 / p["median_s"])
        if n != "mesp-sft":  # ratios from the measured numbers
            assert x[f"{n}_peak"] == p["peak_bytes"] / v["mesp-sft"]["peak_bytes"]
            assert x[f"{n}_time"] == p["median_s"] / v["mesp-sft"]["median_s"]
    # the same model and rows: DP holds what SFT does and the per-example gradients
    assert v["mesp-dp-layer"]["peak_bytes"] >= v["mesp-sft"]["peak_bytes"]
    assert v["mesp-dp-flat"]["peak_bytes"] >= v["mesp-dp-layer"]["peak_bytes"]
    # Opacus keeps a per-sample gradient of every LoRA parameter and HF's full activations
    assert v["peft-opacus"]["peak_bytes"] > v["mesp-dp-flat"]["peak_bytes"]
    assert row["meets"]["layer_peak"] == (x["mesp-dp-layer_peak"] <= TARGETS["layer_peak"])
    assert "layer_time" in row["meets"] and "flat_time" in row["meets"]
    assert "mesp-dp-layer peak" in capsys.readouterr().out
    assert "## DP-SGD beside SFT (`mesp bench dp`)" in md.read_text()


def test_dp_bench_refuses_bad_variants(tmp_path: Path) -> None:
    with pytest.raises(MespError, match="mesp-sft needed"):
        run(_ns([*TINY, "--engines", "mesp-dp-flat", "--out", str(tmp_path)]))
