"""`mesp bench`: the paper's tables, each configuration measured in its own child process.

Tables: 1 model size (Qwen2.5 0.5B/1.5B/3B), 2 sequence length, 3 LoRA rank, 5 keeping h = xAᵀ
versus recomputing it. A configuration is (variant, shape, seq, rank); a variant is an engine
plus its options (our 4-bit model, or the unquantized PEFT baseline). Every result is one JSON
file under OUT/rows/<table>/, written as soon as it is measured, so a long sweep can be run in
pieces (one shape at a time) and the report is rebuilt from whatever rows exist.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mesp.bench.output import write_row
from mesp.bench.variants import ChildConfig
from mesp.errors import MespError
from mesp.memory.rss import run_child

# Variant -> ChildConfig overrides. mesp-fp is mesp on an unquantized base: PEFT cannot use
# our 4-bit layout, so this is the like-for-like comparison with peft-gc.
VARIANTS: dict[str, dict[str, Any]] = {
    "bp": {"engine": "bp"},
    "mebp": {"engine": "mebp"},
    "mesp": {"engine": "mesp"},
    "mesp-store": {"engine": "mesp", "h_strategy": "store"},
    "mezo": {"engine": "mezo"},
    "peft-gc": {"engine": "peft", "bits": None},
    "mesp-fp": {"engine": "mesp", "bits": None},
    "mesp-disk": {"engine": "mesp", "offload": "disk"},
    "mesp-stream": {"engine": "mesp", "offload": "disk", "stream_weights": True},
    # budget-aware recompute: a budget so generous that the planner keeps every block's tape
    "mesp-budget": {"engine": "mesp", "max_memory": "1TB"},
}


@dataclass(frozen=True)
class TableSpec:
    title: str
    shapes: tuple[str, ...]
    seqs: tuple[int, ...]
    ranks: tuple[int, ...]
    variants: tuple[str, ...]


_Q05 = ("qwen2.5-0.5b",)
_T1 = ("bp", "mebp", "mesp", "mezo", "peft-gc", "mesp-fp", "mesp-stream")
TABLES: dict[str, TableSpec] = {
    "table1": TableSpec(
        "Table 1: model size", ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b"), (256,), (8,), _T1
    ),
    "table2": TableSpec(
        "Table 2: sequence length", _Q05, (128, 256, 512, 1024, 2048, 4096), (8,), ("mebp", "mesp")
    ),
    "table3": TableSpec("Table 3: LoRA rank", _Q05, (256,), (4, 8, 16, 32), ("mebp", "mesp")),
    "table5": TableSpec(
        "Table 5: store h vs recompute h", ("qwen2.5-3b",), (256,), (8,), ("mesp", "mesp-store")
    ),
}
TABLES["offload"] = TableSpec(
    "Offload: checkpoints and weights on disk",
    _Q05,
    (1024,),
    (8,),
    ("mesp", "mesp-disk", "mesp-stream"),
)
TABLES["budget"] = TableSpec(
    "Budget-aware recompute: mesp keeping every tape, against bp and plain mesp",
    _Q05,
    (256,),
    (8,),
    ("bp", "mesp", "mesp-budget"),
)
_TINY = ("tiny-qwen2",)
QUICK: dict[str, TableSpec] = {
    "table1": replace(TABLES["table1"], shapes=_TINY, seqs=(64,)),
    "table2": replace(TABLES["table2"], shapes=_TINY, seqs=(32, 128)),
    "table3": replace(TABLES["table3"], shapes=_TINY, seqs=(64,), ranks=(4, 16)),
    "table5": replace(TABLES["table5"], shapes=_TINY, seqs=(64,)),
    "offload": replace(TABLES["offload"], shapes=_TINY, seqs=(64,)),
    "budget": replace(TABLES["budget"], shapes=_TINY, seqs=(64,)),
}


@dataclass
class BenchOptions:
    quick: bool = False
    engines: tuple[str, ...] | None = None  # variants to run; the table's other columns: skipped
    shapes: tuple[str, ...] | None = None
    seqs: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None
    skip: tuple[str, ...] = ()  # "variant@shape" or "variant@shape@seq": not run, with a reason
    dtype: str = "bfloat16"
    steps: int = 3
    rss_steps: int = 1
    warmup: int = 1
    timeout: float = 3600.0  # seconds per configuration
    threads: int | None = None
    matmul: str = "auto"  # bf16 matmul kernel: auto | native | fp32 (MESP_BF16_MATMUL, ops/matmul)
    device: str = "cpu"  # "meta": exact peak only (no arithmetic, no RSS, no time)
    out: Path = field(default_factory=lambda: Path("bench_results"))
    command: str = ""


def spec_for(table: str, opts: BenchOptions) -> TableSpec:
    base = (QUICK if opts.quick else TABLES).get(table)
    if base is None:
        raise MespError(f"unknown table {table!r}; choose from {', '.join(TABLES)}")
    bad = [v for v in opts.engines or () if v not in VARIANTS]
    if bad:
        raise MespError(f"unknown engine(s) {bad}; choose from {', '.join(VARIANTS)}")
    variants = base.variants + tuple(v for v in opts.engines or () if v not in base.variants)
    return replace(
        base,
        shapes=opts.shapes or base.shapes,
        seqs=opts.seqs or base.seqs,
        ranks=opts.ranks or base.ranks,
        variants=variants,
    )


def row_path(out: Path, table: str, c: ChildConfig) -> Path:
    meta = "_meta" if c.device == "meta" else ""
    name = f"{c.variant}_{c.shape}_s{c.seq}_r{c.rank}_{c.dtype}{meta}.json"
    return out / "rows" / table / name


def _skip_reason(c: ChildConfig, opts: BenchOptions) -> str | None:
    if opts.engines is not None and c.variant not in opts.engines:
        return "not in --engines"
    if c.device == "meta" and c.engine == "peft":
        return "the PEFT baseline runs on real tensors only"
    keys = {f"{c.variant}@{c.shape}", f"{c.variant}@{c.shape}@{c.seq}"}
    if keys & set(opts.skip):
        return "--skip"
    return None


def run_part(
    c: ChildConfig, part: str, timeout: float, threads_env: dict[str, str]
) -> dict[str, Any]:
    """One part of a configuration in a fresh child: the memory part with FAITHFUL_MALLOC_ENV
    (RSS that follows live memory), the time part without it (MALLOC_MMAP_THRESHOLD_ makes
    every temporary fresh page faults). Failures become rows, never exceptions."""
    pc = replace(c, part=part)
    t0 = time.perf_counter()
    try:
        argv = ["-m", "mesp.bench.child", json.dumps(asdict(pc))]
        res = run_child(argv, threads_env, timeout, faithful_malloc=part == "memory")
    except MespError as e:
        status = "skipped" if "timed out" in str(e) else "failed"
        res = {"status": status, "reason": str(e), "config": asdict(pc)}
    res["wall_s"] = time.perf_counter() - t0
    return res


# What the time part adds to the memory part's row.
_TIME_FIELDS = ("time", "gemm", "matmul_floor")


def run_config(c: ChildConfig, timeout: float, threads_env: dict[str, str]) -> dict[str, Any]:
    """One configuration: the memory child, then (on the CPU, if that one measured) the time
    child; one row of both, with each child's status, malloc variables and wall time under
    "children"."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    row = run_part(c, "memory", timeout, threads_env)
    parts = {"memory": row}
    if row.get("status") == "ok" and c.device != "meta":
        parts["time"] = timed = run_part(c, "time", timeout, threads_env)
        for k in _TIME_FIELDS:
            row[k] = timed.get(k) if timed.get("status") == "ok" else None
        if timed.get("status") != "ok":
            row["time_reason"] = f"{timed.get('status')}: {timed.get('reason', '')}"
        row["time_losses"] = timed.get("losses")
        row["load_after"] = timed.get("load_after", row.get("load_after"))
    else:
        row.update({k: None for k in _TIME_FIELDS})
    row["children"] = {
        p: {k: r.get(k) for k in ("status", "reason", "malloc_env", "wall_s", "build_s")}
        for p, r in parts.items()
    }
    row["config"] = {k: v for k, v in row["config"].items() if k != "part"}
    row.update(wall_s=sum(r["wall_s"] for r in parts.values()), load_before=load)
    return row


def run_table(table: str, opts: BenchOptions) -> list[dict[str, Any]]:
    """Measure every configuration of `table`; returns the rows (also written as JSON)."""
    spec = spec_for(table, opts)
    env = {"OMP_NUM_THREADS": str(opts.threads)} if opts.threads else {}
    rows = []
    for shape in spec.shapes:
        for seq in spec.seqs:
            for rank in spec.ranks:
                for variant in spec.variants:
                    c = ChildConfig(
                        variant=variant,
                        shape=shape,
                        seq=seq,
                        rank=rank,
                        dtype=opts.dtype,
                        warmup=opts.warmup,
                        steps=opts.steps,
                        rss_steps=opts.rss_steps,
                        timeline=True,
                        threads=opts.threads,
                        matmul=opts.matmul,
                        device=opts.device,
                        **VARIANTS[variant],
                    )
                    reason = _skip_reason(c, opts)
                    path = row_path(opts.out, table, c)
                    if reason is not None and path.exists():
                        continue  # measured by an earlier run: a skip must not erase it
                    if reason is None:
                        row = run_config(c, opts.timeout, env)
                    else:
                        row = {"status": "skipped", "reason": reason, "config": asdict(c)}
                    row.update(table=table, quick=opts.quick, command=opts.command)
                    rows.append(write_row(path, row, summary, table))
    return rows


def summary(row: dict[str, Any]) -> str:
    """One line per row, for progress output."""
    c = row["config"]
    head = f"{c['variant']:<10} {c['shape']} s{c['seq']} r{c['rank']} {c['dtype']}:"
    if row["status"] != "ok":
        return f"{head} {row['status']} ({row.get('reason', '')})"
    e, mib = row["exact"], 2**20
    text = f"{head} exact total {e['total'] / mib:.1f} MiB, working {e['working'] / mib:.1f} MiB"
    if row.get("rss"):
        text += f", rss step {row['rss']['step_bytes'] / mib:.1f} MiB"
    if row.get("time"):
        t, f = row["time"], row.get("matmul_floor") or {}
        text += f", {t['median_s']:.3g} s/step"
        if f:
            text += f" (matmul floor {f['seconds']:.3g} s, {t['floor_ratio']:.2f}x)"
    elif row.get("time_reason"):
        text += f", time {row['time_reason']}"
    return text + (" (meta device)" if c.get("device") == "meta" else "")


__all__ = ["QUICK", "TABLES", "VARIANTS", "BenchOptions", "run_table", "spec_for"]
