"""`mesp bench profile` (a profiled step's time split by kind of work) and `mesp bench speed`
(variants side by side in one process): tiny shapes through the CLI (row, line, report
section) and the accounting on hand-made events; nothing is timed against a threshold."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from mesp.bench.output import load_rows
from mesp.bench.profile import KINDS, breakdown, kind_of
from mesp.cli.bench import add_parser, run
from mesp.errors import MespError


@dataclass
class _Event:  # the fields of torch.profiler's FunctionEventAvg that breakdown reads
    key: str
    self_cpu_time_total: float  # microseconds
    count: int
    input_shapes: list


def test_breakdown_sums_kinds_and_counts_gemm_flops() -> None:
    events = [
        _Event("aten::mm", 2e6, 4, [[256, 896], [896, 292], [256, 292]]),
        _Event("aten::addmm_", 1e6, 2, [[256, 896], [256, 292], [292, 896], [], []]),
        _Event("aten::_scaled_dot_product_flash_attention_for_cpu", 0.45e6, 1, []),
        _Event("aten::mul", 0.375e6, 10, [[1, 256, 4864], []]),
        _Event("aten::mul", 0.125e6, 5, [[1, 256, 896], []]),
    ]
    b = breakdown(events, wall_s=5.0)
    assert b["seconds"] == pytest.approx(
        {"gemm": 3.0, "attention": 0.45, "elementwise": 0.5, "outside ops": 1.05}
    )
    assert sum(b["shares"].values()) == pytest.approx(1.0)
    flops = 4 * 2 * 256 * 896 * 292 + 2 * 2 * 256 * 292 * 896
    assert b["gemm_flops"] == flops and b["gemm_gflops"] == pytest.approx(flops / 3.0 / 1e9)
    # one entry per op over its input shapes, largest first, GEMMs left out
    assert [t["op"] for t in b["top_non_gemm"]] == [
        "aten::mul",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ]
    assert b["top_non_gemm"][0] == {"op": "aten::mul", "seconds": 0.5, "calls": 15}
    assert kind_of("aten::addmm") == "gemm" and kind_of("aten::silu") == "elementwise"


def _ns(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mesp")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    return parser.parse_args(argv)


def test_profile_command_on_a_tiny_shape(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    md = tmp_path / "BENCHMARKS.md"
    argv = ["bench", "profile", "--engines", "mesp,mesp-fp", "--shapes", "tiny-qwen2"]
    argv += ["--dtype", "float32", "--steps", "1", "--warmup", "1"]
    assert run(_ns([*argv, "--out", str(tmp_path), "--markdown", str(md)])) == 0
    rows = [r for r in load_rows(tmp_path) if r["table"] == "profile"]
    assert sorted(r["config"]["bits"] or 0 for r in rows) == [0, 4]
    for r in rows:
        assert set(r["seconds"]) == set(KINDS) and r["seconds"]["gemm"] > 0
        assert sum(r["seconds"].values()) >= r["profiled_s"] * 0.999
        assert r["gemm_gflops"] > 0 and r["floor_s"] > 0 and len(r["steps_s"]) == 1
    assert "profiled step: gemm" in capsys.readouterr().out
    text = md.read_text()
    assert "## Where a step's time goes (`mesp bench profile`)" in text
    assert "mesp bench profile --engines mesp,mesp-fp --shapes tiny-qwen2" in text


def test_profile_refuses_an_engine_it_cannot_build(tmp_path: Path) -> None:
    with pytest.raises(MespError, match="profile: --engines takes mesp, mebp, bp"):
        run(_ns(["bench", "profile", "--engines", "peft-gc", "--out", str(tmp_path)]))


def test_speed_runs_variants_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`mesp bench speed`: every variant's step in each round, ratios taken within rounds."""
    from mesp.bench.speed import paired

    md = tmp_path / "BENCHMARKS.md"
    argv = ["bench", "speed", "--engines", "mesp,mebp,mesp-fp,mesp:bfloat16"]
    argv += ["--shapes", "tiny-qwen2", "--seq", "64", "--dtype", "float32", "--steps", "3"]
    assert run(_ns([*argv, "--warmup", "1", "--out", str(tmp_path), "--markdown", str(md)])) == 0
    (row,) = [r for r in load_rows(tmp_path) if r["table"] == "speed"]
    names = ["mesp:float32", "mebp:float32", "mesp-fp:float32", "mesp:bfloat16"]
    assert row["config"]["variants"] == names and list(row["variants"]) == names
    assert len(row["probe_gflops"]["float32"]) == 3  # bf16 runs on the fp32 GEMM here: one probe
    for v in row["variants"].values():
        assert len(v["steps_s"]) == len(v["floor_ratios"]) == 3 and v["median_s"] > 0
    t = {n: row["variants"][n]["steps_s"] for n in names}
    want = sorted(a / b for a, b in zip(t["mebp:float32"], t["mesp:float32"], strict=True))[1]
    assert paired(row, "mebp", "mesp") == want
    assert paired(row, "mesp:bfloat16", "mesp:float32") is not None
    assert paired(row, "peft-gc", "mesp") is None  # not in this run
    assert "tiny-qwen2 s64 r8, 3 rounds: mesp:float32" in capsys.readouterr().out
    assert "## Step time side by side (`mesp bench speed`)" in md.read_text()


def test_speed_matmul_switch_is_the_runs_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--matmul fp32 holds for the run's steps and is undone after it, even on an error."""
    from mesp.ops import matmul as matmul_ops

    monkeypatch.setenv(matmul_ops.ENV, "native")
    argv = ["bench", "speed", "--engines", "mesp:bfloat16", "--shapes", "tiny-qwen2"]
    argv += ["--seq", "16", "--steps", "1", "--warmup", "0", "--matmul", "fp32"]
    assert run(_ns([*argv, "--out", str(tmp_path)])) == 0
    (row,) = [r for r in load_rows(tmp_path) if r["table"] == "speed"]
    assert row["config"]["matmul"] == "fp32"
    assert os.environ[matmul_ops.ENV] == "native"
    with pytest.raises(MespError, match="unknown variant"):
        run(
            _ns(["bench", "speed", "--engines", "nope", "--matmul", "fp32", "--out", str(tmp_path)])
        )
    assert os.environ[matmul_ops.ENV] == "native"


def test_speed_refuses_unknown_variants_and_dtypes(tmp_path: Path) -> None:
    for bad, msg in (("mesp,nope", "unknown variant 'nope'"), ("mesp:int8", "must be float32")):
        with pytest.raises(MespError, match=msg):
            run(_ns(["bench", "speed", "--engines", bad, "--out", str(tmp_path)]))


def _speed_row(times: dict[str, list[float]]) -> dict:
    v = {
        n: {"steps_s": ts, "median_s": sorted(ts)[1], "tokens_per_s": 256 / sorted(ts)[1],
            "floor_ratios": [t / 5.0 for t in ts], "floor_ratio": sorted(ts)[1] / 5.0}
        for n, ts in times.items()
    }  # fmt: skip
    c = {"shape": "qwen2.5-0.5b", "seq": 256, "rank": 8, "dtype": "float32", "rounds": 3}
    return {"table": "speed", "status": "ok", "command": "mesp bench speed", "variants": v,
            "config": {**c, "variants": list(times), "warmup": 1, "threads": 2},
            "probe_gflops": {"float32": [100.0, 120.0, 110.0]}, "bf16_gemm": False}  # fmt: skip


def test_time_targets_come_from_the_side_by_side_row() -> None:
    """Round by round, peft+gc's step over mesp's is 1.2, 1.0, 1.1: the target reads the
    median of those, 1.10, where the per-variant medians (7.5 / 6.5 s) would say 1.15."""
    from mesp.bench.targets import targets

    row = _speed_row({
        "mesp:float32": [6.0, 7.5, 6.5],
        "peft-gc:float32": [7.2, 7.5, 7.15],
        "mesp:bfloat16": [6.6, 8.0, 7.0],
    })  # fmt: skip
    text = "\n".join(targets([row], "float32"))
    budget = _speed_row({"mesp-budget:float32": [4.0, 4.4, 5.0], "bp:float32": [5.0, 5.5, 5.5]})
    budget["config"]["rounds"] = 3
    with_bp = "\n".join(targets([row, budget], "float32"))
    # bp's step over the kept-tape one, per round: 1.25, 1.25, 1.1
    assert (
        "mesp with budget (kept tapes) / bp tokens/s (side by side) | 1.25 | ≥ 0.95 | met"
        in with_bp
    )
    assert "| qwen2.5-0.5b: mesp 4-bit / peft+gc tokens/s (all blocks recomputed) (side by " \
        "side) | 1.10 | ≥ 1.05 | met |" in text  # fmt: skip
    # each round's bf16 step over its fp32 one: 1.1, 1.067, 1.077; the bf16 target reads rows
    # whose bf16 ran on the fp32 GEMM (this synthetic row: a CPU without a bf16 GEMM)
    assert "bf16 (computed in fp32) / fp32 step time, 4-bit base (side by side) | 1.08 | ≤ 1.15 " \
        "| met" in text  # fmt: skip
    native = targets([{**row, "bf16_gemm": True}], "float32")
    assert "4-bit base (side by side) | – | ≤ 1.15 | not measured" in "\n".join(native)
    assert "mesp step / matmul floor (side by side) | 1.30 | ≤ 1.15 | MISSED" in text
    assert "rounds ranged 1.20–1.50" in text
    assert "mesp / mebp step time (side by side) | – | ≤ 1.1 | not measured" in text
