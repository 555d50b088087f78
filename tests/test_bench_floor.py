"""The timing harness of issue 17 item 5: the matmul floor, the malloc setting per child (RSS
child with it, time child without), one dtype per report table with fp32 as the headline where
the CPU has no bf16 GEMM, and the new target rows. Tiny shapes and synthetic rows: nothing here
times anything against a threshold."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from mesp.bench import floor as bench_floor
from mesp.bench import targets as bench_targets
from mesp.bench.output import write_row
from mesp.bench.report import section, write_report
from mesp.bench.tables import VARIANTS, run_config
from mesp.bench.variants import ChildConfig, shape_dict
from mesp.config import ModelConfig
from mesp.memory import rss
from mesp.ops import matmul as matmul_ops

MiB = 2**20


def _cfg(shape: str) -> ModelConfig:
    return ModelConfig.from_hf(shape_dict(shape), source=shape)


def test_matmul_floor_on_known_configs() -> None:
    # tiny-qwen2: 2 blocks of q,o 128x128, k,v 64x128, gate,up,down 128x384; head 2048x128
    assert (
        bench_floor.matmul_params(_cfg("tiny-qwen2"))
        == 2 * (2 * 128**2 + 2 * 64 * 128 + 3 * 128 * 384) + 2048 * 128
    )
    # Qwen2.5-0.5B: 24 blocks (hidden 896, 14 heads / 2 kv of 64, MLP 4864) + the 151936-row head
    n = 24 * (2 * 896**2 + 2 * 128 * 896 + 3 * 896 * 4864) + 151936 * 896
    cfg = _cfg("qwen2.5-0.5b")
    assert bench_floor.matmul_params(cfg) == n == 493_961_216
    assert bench_floor.floor_flops(cfg, 256) == 6 * n * 256
    f = bench_floor.matmul_floor(cfg, 256, gflops=100.0)
    assert f == {"params": n, "tokens": 256, "flops": 6 * n * 256, "seconds": 6 * n * 256 / 100e9}


def test_gemm_probe_runs_in_the_dtype_the_step_multiplies_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = _cfg("tiny-qwen2")
    g = bench_floor.gemm_rate(cfg, 16, torch.float32, passes=2)
    block = (bench_floor.matmul_params(cfg) - 2048 * 128) // 2
    assert g["pass_flops"] == 2 * 2 * 16 * block and len(g["passes_s"]) == 2
    assert g["gflops"] > 0 and g["dtype"] == "float32"
    monkeypatch.setenv(matmul_ops.ENV, "fp32")  # a CPU without a bf16 GEMM: fp32 kernels
    assert bench_floor.probe_dtype(torch.bfloat16) == torch.float32
    monkeypatch.setenv(matmul_ops.ENV, "native")
    assert bench_floor.probe_dtype(torch.bfloat16) == torch.bfloat16


def test_malloc_setting_only_in_the_rss_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """The env each child process is started with: the memory (RSS) child gets
    FAITHFUL_MALLOC_ENV, the time child none of it, not even where the parent has it set."""
    for k, v in rss.FAITHFUL_MALLOC_ENV.items():
        monkeypatch.setenv(k, v)  # inherited by the bench's own process
    started: list[tuple[str, dict[str, str]]] = []

    def fake_run(argv: list[str], env: dict[str, str], **_: Any) -> subprocess.CompletedProcess:
        c = json.loads(argv[-1])
        started.append((c["part"], env))
        res: dict[str, Any] = {"status": "ok", "config": c, "losses": [1.0]}
        if c["part"] == "memory":
            res.update(exact={"working": 1}, rss={"step_bytes": 1})
        else:
            res.update(time={"median_s": 2.0}, gemm={"gflops": 1.0}, matmul_floor={"seconds": 1.0})
        return subprocess.CompletedProcess(argv, 0, rss.RESULT_PREFIX + json.dumps(res), "")

    monkeypatch.setattr(rss.subprocess, "run", fake_run)
    c = ChildConfig(variant="mesp", shape="tiny-qwen2", seq=16, **VARIANTS["mesp"])
    row = run_config(c, 60.0, {"OMP_NUM_THREADS": "1"})
    assert [p for p, _ in started] == ["memory", "time"]
    mem_env, time_env = started[0][1], started[1][1]
    assert {k: mem_env[k] for k in rss.FAITHFUL_MALLOC_ENV} == rss.FAITHFUL_MALLOC_ENV
    assert not set(rss.FAITHFUL_MALLOC_ENV) & set(time_env)
    assert mem_env["OMP_NUM_THREADS"] == time_env["OMP_NUM_THREADS"] == "1"
    # one row: memory from the RSS child, time from the time child
    assert row["exact"] == {"working": 1} and row["time"] == {"median_s": 2.0}
    assert row["matmul_floor"] == {"seconds": 1.0} and "part" not in row["config"]
    assert set(row["children"]) == {"memory", "time"}

    started.clear()  # the meta device: exact peak only, no time child
    from dataclasses import replace

    row = run_config(replace(c, device="meta"), 60.0, {})
    assert [p for p, _ in started] == ["memory"] and row["time"] is None


def _row(variant: str, dtype: str, work: float, s: float | None, fl: float | None = None,
         table: str = "table1") -> dict:  # fmt: skip
    bits = None if variant in ("peft-gc", "mesp-fp") else 4
    c = {"variant": variant, "shape": "qwen2.5-0.5b", "seq": 256, "rank": 8, "dtype": dtype,
         "bits": bits, "group_size": 64, "device": "cpu"}  # fmt: skip
    w = 300 * MiB
    r: dict[str, Any] = {
        "status": "ok", "table": table, "config": c, "bf16_gemm": False, "timeline": None,
        "exact": {"weights": w, "adapter": MiB, "working": work * MiB,
                  "total": w + MiB + work * MiB},
        "rss": {"step_bytes": 3 * work * MiB, "peak_bytes": 900 * MiB}, "peak_composition": [],
        "time": None if s is None else {"median_s": s, "tokens_per_s": 256 / s},
        "matmul_floor": None if fl is None else {"seconds": fl},
        "gemm": None if fl is None else {"gflops": 100.0, "dtype": "float32"},
        "children": {"memory": {"malloc_env": dict(rss.FAITHFUL_MALLOC_ENV)},
                     "time": {"malloc_env": {}}},
    }  # fmt: skip
    return r


def _rows() -> list[dict]:
    """fp32 table-1 rows with working 11.x MiB and times 1x.x s; bf16 ones with 22.x / 2x.x."""
    rows = []
    for i, v in enumerate(("mebp", "mesp", "peft-gc", "mesp-fp", "mesp-budget")):
        rows.append(_row(v, "float32", 11.0 + i / 10, 13.0 + i / 10, 10.0))
        rows.append(_row(v, "bfloat16", 22.0 + i / 10, 26.0 + i / 10, 10.0))
    return rows


def test_headline_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _rows()
    assert bench_targets.headline_dtype(rows) == "float32"
    assert bench_targets.headline_dtype([{**r, "bf16_gemm": True} for r in rows]) == "bfloat16"
    for native in (True, False):  # rows without the record: this CPU's own check decides
        monkeypatch.setattr(matmul_ops, "native_kernel", lambda dtype, n=native: n)
        expect = "bfloat16" if native else "float32"
        assert bench_targets.headline_dtype([{"status": "ok"}]) == expect
        assert bench_targets.cpu_dtype() == expect


def test_report_never_mixes_dtypes(tmp_path: Path) -> None:
    for r in _rows():
        c = r["config"]
        write_row(tmp_path / "rows" / "table1" / f"{c['variant']}_{c['dtype']}.json", r)
    text = write_report(tmp_path, tmp_path / "BENCHMARKS.md").read_text()
    parts = {p.split("\n", 1)[0]: p for p in text.split("\n## ")}
    f32, b16 = parts["Table 1: model size (float32)"], parts["Table 1: model size (bfloat16)"]
    assert text.index("(float32)") < text.index("# Secondary: bfloat16") < text.index("(bfloat16)")
    assert "11.1 (312.1)" in f32 and "13.1 (19.5); floor 10" in f32
    assert "22." not in f32 and "26." not in f32  # no bf16 number in the fp32 table
    assert "22.1 (323.1)" in b16 and "11." not in b16 and "13." not in b16
    tgt = parts["Targets (float32)"]  # evaluated on the headline rows only
    assert "| qwen2.5-0.5b: mesp step / matmul floor | 1.31 | ≤ 1.15 | MISSED | 14% over |" in tgt
    assert "MALLOC_MMAP_THRESHOLD_" in text and "6·N·T" in text
    # a section asked for one dtype holds that dtype's rows only
    assert "22." not in "\n".join(section(_rows(), "table1", "float32"))


def test_target_rows() -> None:
    rows = [
        _row("mesp", "float32", 50, 11.0, 10.0),  # 1.10x its floor: met
        _row("peft-gc", "float32", 400, 11.0, 10.0),  # same speed as mesp: 1.00 < 1.05
        _row("mesp-fp", "float32", 50, 10.5, 10.0),
        _row("mesp-budget", "float32", 300, 8.0, 10.0, table="budget"),  # 1.375 ≥ 1.3
    ]
    text = "\n".join(bench_targets.targets(rows, "float32"))
    assert "| qwen2.5-0.5b: mesp step / matmul floor | 1.10 | ≤ 1.15 | met | – |" in text
    line = "| qwen2.5-0.5b: mesp 4-bit / peft+gc tokens/s (all blocks recomputed) | 1.00 | ≥ 1.05 |"
    assert line + " MISSED | 5% short |" in text
    kept = "| qwen2.5-0.5b: mesp with budget (kept tapes) / peft+gc tokens/s | 1.38 | ≥ 1.3 | met |"
    assert kept in text
    assert "short by 5%" in text and "1.05x peft+gc" in text  # what bounds the miss
    assert "8.0" not in "\n".join(bench_targets.targets(rows, "bfloat16"))
    # no rows of the headline dtype: every target of the headline configuration listed, unmeasured
    empty = "\n".join(bench_targets.targets([], "float32"))
    assert "| qwen2.5-0.5b: mesp step / matmul floor | – | ≤ 1.15 | not measured | – |" in empty
    assert "kept tapes) / peft+gc tokens/s | – | ≥ 1.3 | not measured" in empty
