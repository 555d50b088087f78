"""`mesp bench quick`: every engine measured in its own child on a tiny shape, rows written as
JSON, plots and a report made. Memory only: the machine is shared, so no timing assertions."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from mesp.bench.output import load_rows
from mesp.bench.tables import QUICK
from mesp.cli.bench import add_parser, run
from mesp.memory.rss import FAITHFUL_MALLOC_ENV


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    out = tmp_path_factory.mktemp("bench")
    md = out / "BENCHMARKS.md"
    parser = argparse.ArgumentParser(prog="mesp")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    # native bf16 kernels: the rows compare the engines' own memory. Where the CPU has no bf16
    # GEMM, the product's fp32 compute adds the same bounded upcast copies to every engine
    # (mesp/ops/matmul.py), which at these tiny shapes are as large as the engines' difference.
    argv = ["bench", "quick", "--steps", "1", "--matmul", "native"]
    argv += ["--out", str(out), "--markdown", str(md)]
    ns = parser.parse_args(argv)
    assert run(ns) == 0
    return out, md, load_rows(out)


def test_rows_for_every_engine(quick_run: tuple[Path, Path, list[dict]]) -> None:
    out, _, rows = quick_run
    by_variant = {r["config"]["variant"]: r for r in rows}
    assert set(by_variant) == set(QUICK["table1"].variants)
    for variant, r in by_variant.items():
        if r["status"] == "skipped":  # only an engine missing from this build may skip
            assert variant == "mezo" and "not available" in r["reason"]
            continue
        assert r["status"] == "ok", (variant, r.get("reason"))
        e = r["exact"]
        assert e["weights"] > 0 and e["adapter"] > 0 and e["working"] > 0
        assert e["total"] == e["weights"] + e["adapter"] + e["working"]
        assert r["rss"]["peak_bytes"] > 0 and r["time"]["median_s"] > 0
        assert r["timeline"] and max(r["timeline"]) > 0
        # RSS from a child under the faithful-malloc setting, time from one without it: the
        # variables each real child process saw, as it reported them
        assert r["children"]["memory"]["malloc_env"] == FAITHFUL_MALLOC_ENV
        assert r["children"]["time"]["malloc_env"] == {}
        assert r["matmul_floor"]["params"] == 655_360 and r["gemm"]["gflops"] > 0
        # each timed step against the floor at the GEMM rate probed right before it
        t, g = r["time"], r["gemm"]
        assert len(t["floor_ratios"]) == len(t["steps_s"]) == len(g["per_step_gflops"])
        assert t["floor_ratio"] == statistics.median(t["floor_ratios"])
        for s, rate, x in zip(t["steps_s"], g["per_step_gflops"], t["floor_ratios"], strict=True):
            assert x == pytest.approx(s / (r["matmul_floor"]["flops"] / (rate * 1e9)))
        assert g["gflops"] == statistics.median(g["per_step_gflops"])
    assert len(list((out / "rows" / "table1").glob("*.json"))) == len(by_variant)


def test_mesp_peak_at_most_mebp(quick_run: tuple[Path, Path, list[dict]]) -> None:
    """At this tiny shape the loss head, not a block, sets both peaks, so mesp and mebp sit
    within a few percent (tests/test_memory_model.py measures mesp well below mebp where a
    block's working set counts); bp's whole-graph peak is above both."""
    rows = {r["config"]["variant"]: r["exact"] for r in quick_run[2]}
    for part in ("total", "working"):
        assert rows["mesp"][part] <= 1.05 * rows["mebp"][part] < 1.05 * rows["bp"][part]


def test_report_and_plots(quick_run: tuple[Path, Path, list[dict]]) -> None:
    out, md, _ = quick_run
    pngs = sorted(out.glob("*.png"))
    assert pngs and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    text = md.read_text()
    assert "Table 1" in text and "timeline.png" in text and "mesp bench quick" in text
    row = json.loads(next((out / "rows" / "table1").glob("mesp_*.json")).read_text())
    assert row["peak_composition"][0]["bytes"] > 0


def test_bench_dequant_rows_and_report(tmp_path: Path) -> None:
    """The dequant table: one row per (dtype, shape, tokens) with both timings, and a report
    section that names the command."""
    from mesp.bench import dequant as bench_dequant

    c = bench_dequant.DequantConfig("bfloat16", 64, 128, 4, threads=1)
    row = {**bench_dequant.measure(c, steps=2, warmup=1), "command": "mesp bench dequant"}
    assert row["dequant_ms"] > 0 and row["matmul_ms"] > 0
    assert row["ratio"] == row["dequant_ms"] / row["matmul_ms"]
    text = "\n".join(bench_dequant.section([row]))
    assert "mesp bench dequant" in text and "| bfloat16 | 64x128 | 4 |" in text


def test_bench_dequant_layer_step_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer-step rows: every base timed through frozen_matmul forward and backward, the
    ratio against dense fp32, and the report's table and target line (no threshold tested)."""
    from mesp.bench import dequant as bench_dequant
    from mesp.bench import layer_step

    monkeypatch.setattr(layer_step, "LAYER", ((96, 64), (64, 128)))  # one row-cut, one column-cut
    rows = [
        layer_step.measure_layer_step(d, 256, steps=2, warmup=1) for d in ("float32", "bfloat16")
    ]
    for r in rows:
        assert r["part"] == "layer" and min(r["quant_ms"], r["dense_ms"], r["dense_fp32_ms"]) > 0
        lo, hi = r["ratio_range"]  # the median of 2 per-round ratios lies between them
        assert r["rounds"] == 2 and 0 < lo <= r["ratio"] <= hi
    assert rows[0]["dense_ms"] == rows[0]["dense_fp32_ms"]  # fp32: one dense base
    text = "\n".join(bench_dequant.section(rows))
    assert "### Layer-step" in text and "| float32 | 256 |" in text and "| bfloat16 | 256 |" in text
    assert "Target fp32 4-bit layer-step at 256 tokens" in text and "over 2)" in text


def test_bench_dropin_rows_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mesp bench dropin --quick` on the tiny Qwen2 shape: one row per configuration under
    rows/dropin with its command, the patch really applied, the report section, and the meta
    device's exact peak equal to the CPU's in every configuration. The children run in this
    process here (the CLI runs each in its own)."""
    import torch.nn.functional as F
    import transformers.masking_utils as mu

    from mesp.bench import dropin as dropin_bench

    # the meta run's shims replace these module attributes: restore them after the test
    monkeypatch.setattr(F, "scaled_dot_product_attention", F.scaled_dot_product_attention)
    monkeypatch.setattr(mu, "find_packed_sequence_indices", mu.find_packed_sequence_indices)

    def in_process(argv: list[str], **_: object) -> dict:
        c = dropin_bench.DropinConfig(**json.loads(argv[-1]))
        return {"status": "ok", **dropin_bench._measure(c)}

    monkeypatch.setattr(dropin_bench, "run_child", in_process)
    md = tmp_path / "BENCHMARKS.md"
    parser = argparse.ArgumentParser(prog="mesp")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    argv = ["bench", "dropin", "--quick", "--seq", "32", "--steps", "1", "--out", str(tmp_path)]
    assert run(parser.parse_args([*argv, "--markdown", str(md)])) == 0
    assert run(parser.parse_args([*argv, "--device", "meta"])) == 0
    metas = sorted((tmp_path / "rows" / "dropin").glob("*_meta.json"))
    files = sorted(set((tmp_path / "rows" / "dropin").glob("*.json")) - set(metas))
    loaded = [json.loads(f.read_text()) for f in files]
    rows = {dropin_bench.config_name(r["config"]): r for r in loaded}
    assert set(rows) == {"unpatched", "unpatched+gc", "patched", "patched+gc"} and len(files) == 4
    for name, r in rows.items():
        assert r["status"] == "ok" and r["table"] == "dropin", (name, r.get("reason"))
        assert r["command"].startswith("mesp bench dropin --quick --shapes tiny-qwen2 --seq 32")
        e = r["exact"]
        assert e["total"] == e["weights"] + e["adapter"] + e["working"] and e["working"] > 0
        assert r["patched_modules"] == (2 * 8 if r["config"]["patched"] else 0)
        assert r["time_s"] > 0 and r["cpu_s"] >= 0
    for r in map(json.loads, map(Path.read_text, metas)):
        assert r["status"] == "ok" and r["time_s"] is None
        assert r["exact"] == rows[dropin_bench.config_name(r["config"])]["exact"]
    for gc in ("", "+gc"):
        u, p = rows[f"unpatched{gc}"], rows[f"patched{gc}"]
        assert p["exact"]["working"] < u["exact"]["working"]
        assert p["losses"][0] == pytest.approx(u["losses"][0], rel=1e-5)  # same first step
    text = md.read_text()
    assert "## Drop-in: HF + PEFT" in text and "Command: `mesp bench dropin" in text
    assert "| 32 | patched+gc |" in text and "| 32 | on |" in text  # CPU rows win over meta


def test_bf16_against_fp32_section_pairs_the_same_configuration() -> None:
    from mesp.bench.report import dtype_section

    def row(dtype: str, s: float, variant: str = "mesp") -> dict:
        c = {"variant": variant, "shape": "qwen2.5-0.5b", "seq": 256, "rank": 8, "dtype": dtype}
        return {"status": "ok", "table": "table1", "config": c, "matmul": "fp32 compute (x)",
                "time": {"median_s": s, "tokens_per_s": 256 / s}}  # fmt: skip

    text = "\n".join(dtype_section([row("float32", 10.0), row("bfloat16", 11.0)]))
    assert "## bf16 against fp32" in text and "| 1.10 | fp32 compute |" in text
    assert dtype_section([row("float32", 10.0), row("bfloat16", 11.0, "mebp")]) == []


def test_ondevice_section_names_the_cpu_and_the_ratio() -> None:
    """The on-device table computes native / engine from the row's two medians and names the
    CPU each row ran on (rows from two machines are never paired); an old row says so."""
    from mesp.bench.ondevice import section

    def row(cpu: str | None) -> dict:
        r = {
            "table": "ondevice",
            "status": "ok",
            "config": {"shape": "qwen2.5-0.5b", "seq": 256, "bits": 4},
            "native": {
                "median_s": 9.0,
                "peak_anon_bytes": 150e6,
                "peak_rss_bytes": 300e6,
                "planned_bytes": {"g0.backward": 80e6, "loss_slice": 50e6},
            },
            "engine": {"median_s": 6.0, "peak_rss_bytes": 900e6},
        }
        return r | ({"cpu": cpu} if cpu else {})

    first = row("Xeon, 2 cores")  # its breakdown is shown: the runner's seconds per program
    first["native"]["program_s"] = {"loss_slice": 1.5, "g0.backward": 4.0}
    text = "\n".join(section([first, row(None)]))
    assert (
        "Runner seconds per program in a step (median; the rest of the step's 9.00 s is outside "
        "the programs): g0.backward 4.00, loss_slice 1.50." in text
    )
    assert "Runner seconds" not in "\n".join(section([row(None)]))  # a row from before: none
    assert "| 9.00 | 6.00 | 1.50 | 150.0 |" in text
    assert "| 80.0 (g0.backward) | Xeon, 2 cores |" in text
    assert "| not recorded |" in text


def test_ondevice_section_shows_the_outside_poll_and_flags_a_dishonest_peak() -> None:
    """The table's outside-poll column is the larger of the runner's own figure and the 5 ms
    poll's, marked (!) where the poll read more than the runner reported + 2%; the paper ratio
    uses that larger figure; a row from before the poll says 'not polled'."""
    from mesp.bench.ondevice import line, section

    def row(own: float, polled: float | None) -> dict:
        native = {
            "median_s": 9.0,
            "peak_anon_bytes": own,
            "peak_rss_bytes": 300e6,
            "planned_bytes": {"loss_slice": 50e6},
        }
        if polled is not None:
            native |= {"polled_peak_anon_bytes": polled, "poll_period_s": 0.005}
        return {
            "table": "ondevice",
            "status": "ok",
            "config": {"shape": "qwen2.5-0.5b", "seq": 256, "bits": 4},
            "native": native,
            "engine": {"median_s": 6.0, "peak_rss_bytes": 900e6},
            "cpu": "x",
        }

    text = "\n".join(section([row(100e6, 101e6), row(100e6, 136.2e6), row(100e6, None)]))
    assert "| 100.0 | 101.0 | 0.74x |" in text
    assert "| 100.0 | 136.2 (!) | 1.00x |" in text
    assert "| 100.0 | not polled | 0.73x |" in text
    assert "outside 5 ms poll 101.0 MB" in line(row(100e6, 101e6))
    assert "engine 6.00 s/step, peak RSS 900.0 MB" in line(row(100e6, None))  # a row before
    timed = row(100e6, None)
    timed["engine"] |= {"steps_s": [5.3, 7.9], "gemm_gflops": 161.2}
    assert "engine 6.00 s/step (steps 5.30, 7.90; GEMM probe 161 GFLOP/s), peak RSS" in line(timed)


def test_ondevice_paper_table_puts_each_cell_beside_the_papers() -> None:
    """The paper's size / sequence / rank cells, each beside the newest plain random-weight row
    of the same shape, seq and rank (honest peak, ratio to the paper's); a real-model or
    block-inputs-on-disk row is not a cell; a cell without a row says 'not run'."""
    from mesp.bench.ondevice_report import PAPER, paper_table

    def row(shape: str, seq: int, rank: int, mb: float, **extra: object) -> dict:
        return {
            "table": "ondevice",
            "status": "ok",
            "config": {"shape": shape, "seq": seq, "bits": 4, "rank": rank, **extra},
            "native": {"median_s": 6.0, "peak_anon_bytes": mb * 1e6, "peak_rss_bytes": 1.0},
            "engine": {"median_s": 4.0, "peak_rss_bytes": 1.0},
            "cpu": "x",
        }

    rows = [
        row("qwen2.5-1.5b", 256, 8, 300.0),
        row("qwen2.5-1.5b", 256, 8, 200.0),  # newer: this one counts
        row("qwen2.5-0.5b", 512, 8, 10.0, checkpoints_on_disk=True),
        row("qwen2.5-0.5b", 256, 32, 150.0, model="qwen2.5-coder-0.5b"),
        row("qwen2.5-0.5b", 256, 4, 120.0),
    ]
    text = "\n".join(paper_table(rows))
    assert "| qwen2.5-1.5b | 256 | 8 | 262.6 | 200.0 | 0.76x | 1.50 | x |" in text
    assert "| qwen2.5-0.5b | 256 | 4 | 132.8 | 120.0 | 0.90x | 1.50 | x |" in text
    assert "| qwen2.5-0.5b | 512 | 8 | 245.8 | not run |" in text
    assert "| qwen2.5-0.5b | 256 | 32 | 158.2 | not run |" in text
    assert text.count("\n| qwen2.5") == len(PAPER)
    assert paper_table([row("qwen2.5-7b", 256, 8, 1.0)]) == []


def test_ondevice_dp_rows_compare_with_the_plain_run_beside_them() -> None:
    """A DP-SGD row is set against the plain native run of the same command (its "plain"),
    by honest peak and step time; it is no cell of the paper's table."""
    from mesp.bench.ondevice_report import paper_table, section

    def native(mb: float, polled: float, s: float) -> dict:
        return {
            "median_s": s,
            "peak_anon_bytes": mb * 1e6,
            "polled_peak_anon_bytes": polled * 1e6,
            "poll_period_s": 0.005,
            "peak_rss_bytes": 300e6,
            "planned_bytes": {"loss_slice": 50e6},
        }

    plain = native(110.0, 112.0, 6.0)
    dp = {
        "table": "ondevice",
        "status": "ok",
        "config": {"shape": "qwen2.5-0.5b", "seq": 256, "bits": 4, "rank": 8, "dp": "flat"},
        "native": native(140.0, 126.0, 6.6),
        "engine": {"median_s": 4.0, "peak_rss_bytes": 1.0},
        "plain": plain,
        "cpu": "x",
    }
    text = "\n".join(section([dp]))
    assert (
        "- qwen2.5-0.5b DP-SGD flat: peak anon 140.0 MB against 112.0 MB plain (1.25x), "
        "6.60 s/step against 6.00 (1.10x), x" in text
    )
    assert paper_table([dp]) == []  # no plain row: no cell
    half = dp | {"config": dp["config"] | {"dp": None, "checkpoint_dtype": "float16"}}
    half["adapter_vs_plain"] = 3.2e-3
    assert (
        "- qwen2.5-0.5b (block inputs in float16): peak anon 140.0 MB against 112.0 MB plain "
        "(1.25x), 6.60 s/step against 6.00 (1.10x), adapter 3.2e-03 of its training move from "
        "plain's, x" in "\n".join(section([half]))
    )
    assert paper_table([half]) == []
