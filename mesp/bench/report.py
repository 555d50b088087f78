"""BENCHMARKS.md and its plots, rebuilt from every JSON row under OUT/rows.

Memory in MiB. "working" is every byte live at the exact peak that is neither a frozen weight
nor adapter (params + grads + optimizer state); "total" adds those two. The paper's numbers
(iPhone phys_footprint, weights streamed from disk) sit beside ours for orientation only.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

from mesp.bench import decode as bench_decode
from mesp.bench import dequant as bench_dequant
from mesp.bench import dp as bench_dp
from mesp.bench import dpo as bench_dpo
from mesp.bench import dropin_report, ondevice_cap
from mesp.bench import ladder as bench_ladder
from mesp.bench import ondevice as bench_ondevice
from mesp.bench import profile as bench_profile
from mesp.bench import softmax as bench_softmax
from mesp.bench import speed as bench_speed
from mesp.bench.cells import (
    LABELS,
    MiB,
    Row,
    cell_mem,
    cell_rss,
    cell_time,
    floor_ratio,
    fmt,
    index,
    mem,
    ok,
    ratio,
    secs,
)
from mesp.bench.cells import grid as _grid
from mesp.bench.method import machine, preamble, table_dtypes
from mesp.bench.output import load_rows
from mesp.bench.plots import PAPER_SEQ, make_plots, variants
from mesp.bench.tables import TABLES
from mesp.bench.targets import headline_dtype, targets

# FACTS.md, from the paper (iPhone 17 Pro): MeBP MB, s, MeSP MB, s.
PAPER_T1 = {
    "qwen2.5-0.5b": (360.8, 0.68, 136.2, 0.86),
    "qwen2.5-1.5b": (516.2, 1.66, 262.6, 2.17),
    "qwen2.5-3b": (637.6, 3.21, 368.4, 4.09),
}
PAPER_RANK = {4: 132.8, 8: 136.2, 16: 143.5, 32: 158.2}
PAPER_H = {"mesp-store": (398.5, 3.85), "mesp": (368.4, 4.09)}


def _floor_cell(r: Row | None) -> str:
    """mesp against memory_model.analytic_floor: the floor counts adapter + working bytes."""
    if not ok(r):
        return "–"
    f = r.get("floor")  # type: ignore[union-attr]
    if not f or "adapter_working" not in f:
        return str(r.get("floor_note") or "–")  # type: ignore[union-attr]
    floor = f["adapter_working"] / MiB
    measured = (r["exact"]["adapter"] + r["exact"]["working"]) / MiB  # type: ignore[index]
    return f"{floor:.1f}; mesp {measured / floor:.2f}x"


def section(rows: list[Row], table: str, dtype: str) -> list[str]:
    """One table of the paper: memory, RSS and time grids over the rows that exist."""
    idx = index(rows, table, dtype)
    if not idx:
        return []
    var = variants(idx)
    cols = [LABELS.get(v, v) for v in var]
    axis = {"table2": 1, "table3": 2}.get(table, 0)  # which config field the rows vary over
    keys = sorted({k[:3] for k in idx}, key=lambda k: (k[0], k[1], k[2]))
    shapes = {k[0] for k in keys}
    name = {0: "model", 1: "seq", 2: "rank"}[axis]
    any_c = next(iter(idx.values()))["config"]
    q = f"{any_c['bits']}-bit g{any_c['group_size']}" if any_c["bits"] else "unquantized"
    out = [
        f"## {TABLES[table].title} ({dtype})",
        "",
        f"{dtype} rows only, batch 1, SGD; base {q} except peft+gc "
        f"and mesp unquant. ({dtype} base). Cells: working MiB (total MiB) of the exact peak; "
        "reduction = 1 − mesp/mebp, as the paper computes it.",
        "",
    ]
    mem_rows, rss_rows, time_rows = [], [], []
    for k in keys:
        rs = [idx.get((*k, v)) for v in var]
        label = str(k[axis]) if axis == 0 or len(shapes) == 1 else f"{k[axis]} ({k[0]})"
        mebp, mesp = idx.get((*k, "mebp")), idx.get((*k, "mesp"))
        # the paper's reduction column, 1 − mesp/mebp, on working and on total bytes
        red = [ratio(mem(mesp, p), mem(mebp, p)) for p in ("working", "total")]
        extra = ["–" if x is None else f"{1 - x:.0%}" for x in red]
        paper = "–"
        if table == "table1" and k[0] in PAPER_T1:
            p = PAPER_T1[k[0]]
            paper = f"{p[0]} / {p[2]} ({1 - p[2] / p[0]:.0%})"
        elif table == "table2" and k[1] in PAPER_SEQ:
            paper = "{} / {}".format(*PAPER_SEQ[k[1]])
        elif table == "table3" and k[2] in PAPER_RANK:
            paper = f"mesp {PAPER_RANK[k[2]]}"
        elif table == "table5":
            (sm, ss), (rm, rs_) = PAPER_H["mesp-store"], PAPER_H["mesp"]
            paper = f"store {sm} MB {ss} s; recompute {rm} MB {rs_} s"
        mem_rows.append([label, *map(cell_mem, rs), *extra, _floor_cell(mesp), paper])
        rss_rows.append([label, *map(cell_rss, rs)])
        if table == "offload":  # the overhead of going to disk, against plain mesp
            tr = ratio(secs(idx.get((*k, "mesp-stream"))), secs(mesp))
        elif table == "budget":  # tokens/s against bp: bp's time over the kept-tape run's
            tr = ratio(secs(idx.get((*k, "bp"))), secs(idx.get((*k, "mesp-budget"))))
        else:
            tr = ratio(secs(mesp), secs(idx.get((*k, "mebp"))))
        time_rows.append([label, *map(cell_time, rs), fmt(tr), fmt(floor_ratio(mesp))])
    out += _grid(
        [
            name,
            *cols,
            "reduction working",
            "reduction total",
            "floor MiB (adapter+working)",
            "paper MeBP / MeSP MB",
        ],
        mem_rows,
    )
    out += ["", "Process RSS of one step: rise over the RSS before it, MiB (absolute peak).", ""]
    out += _grid([name, *cols], rss_rows)
    out += ["", f"Time per step: median s (tokens/s); floor s: {FLOOR_CELL}", ""]
    last = {"offload": "streamed / mesp time", "budget": "every tape kept / bp tokens/s"}.get(
        table, "mesp/mebp time"
    )
    out += _grid([name, *cols, last, "mesp / floor"], time_rows)
    return out + [""]


FLOOR_CELL = (
    "the matmul floor 6·N·T of that row at the GEMM rate its own time child measured just "
    "before its steps (definition in the preamble)."
)


def composition(rows: list[Row], dtype: str, variant: str = "mesp", top: int = 12) -> list[str]:
    """What is live at the exact peak of each measured mesp step (table 1): the tensors to
    shrink next, with the source line that made them."""
    out = []
    for k, r in sorted(index(rows, "table1", dtype).items()):
        if k[3] != variant or not ok(r):
            continue
        out += [f"**{variant}, {k[0]}, seq {k[1]}** (working {mem(r):.1f} MiB):", ""]
        body = [
            [f"{e['bytes'] / MiB:.2f}", str(e["count"]), f"`{e['what']}`"]
            for e in r["peak_composition"][:top]
        ]
        out += _grid(["MiB", "n", "made by (site, op, shape, dtype)"], body) + [""]
    return out


def dtype_section(rows: list[Row]) -> list[str]:
    """bf16 against fp32 step time, wherever one configuration (table, variant, shape, seq,
    rank) has timed rows in both: e.g. `mesp bench table1 --shapes qwen2.5-0.5b --engines
    mesp,mesp-fp` once with `--dtype float32` and once with `--dtype bfloat16`."""
    timed: dict[tuple[Any, ...], dict[str, Row]] = {}
    for r in rows:
        c = r.get("config", {})
        if r.get("table") in TABLES and secs(r) is not None:
            k = (r["table"], c["variant"], c["shape"], c["seq"], c["rank"])
            timed.setdefault(k, {})[c["dtype"]] = r
    body, unpaired = [], []
    for k, by in sorted(timed.items()):
        f32, b16 = by.get("float32"), by.get("bfloat16")
        if f32 is None or b16 is None:
            continue
        t, v, shape, seq, rank = k
        label = f"{LABELS.get(v, v)}, {shape} s{seq} r{rank} ({t})"
        if (
            f32.get("threads") != b16.get("threads")
            or ("children" in f32) != ("children" in b16)
            or f32.get("bf16_gemm") != b16.get("bf16_gemm")
        ):
            unpaired.append(label)  # not timed alike (threads, malloc, CPU): no honest ratio
            continue
        path = str(b16.get("matmul", "–")).split(" (")[0]
        row = [label, cell_time(f32), cell_time(b16), fmt(ratio(secs(b16), secs(f32))), path]
        body.append(row)
    if not body and not unpaired:
        return []
    head = ["configuration", "fp32 s (tokens/s)", "bf16 s (tokens/s)", "bf16 / fp32", "bf16 path"]
    out = ["## bf16 against fp32", "", "Median step time of the same configuration in both "]
    out[-1] += "dtypes (issue 17's target: bf16 within 1.15x of fp32)."
    notes = []
    if unpaired:
        notes = [
            "",
            "Not paired (their two rows were timed with different thread counts, malloc "
            f"settings or CPUs; re-measure both to compare): {'; '.join(unpaired)}.",
        ]
    if not body:  # only the side-by-side rows pair the two dtypes
        notes.append("The targets table takes the ratio from `mesp bench speed` rows instead.")
        return [*out, *notes, ""]
    return [*out, "", *_grid(head, body), *notes, ""]


def cuda_section(rows: list[Row]) -> list[str]:
    """Says so while no row was measured on a CUDA device (issue 17: CUDA is written but its
    numbers need a GPU; a row with config.device cuda replaces this with the tables above)."""
    if any(str(r.get("config", {}).get("device", "")).startswith("cuda") for r in rows):
        return []
    return [
        "## CUDA",
        "",
        "Not yet measured. The CUDA path (`--device cuda`, NCCL data parallel) is written and "
        "its code is tested on the CPU, but no row here ran on a GPU: none was available to "
        "this project's machines when these rows were taken.",
        "",
    ]


def write_report(out: Path, markdown: Path, dtype: str | None = None) -> Path:
    """Plots into OUT, then MARKDOWN from every row under OUT (the tables that exist): the
    headline dtype's targets and tables (`dtype`, or headline_dtype of the rows), then each
    other dtype's tables."""
    rows = load_rows(out)
    headline = dtype or headline_dtype(rows)
    dtypes = table_dtypes(rows, headline)
    pngs = make_plots(rows, out, dtypes)
    loads = [r["load_before"] for r in rows if r.get("load_before") is not None]
    lines = [
        "# Benchmarks",
        "",
        f"Generated {_dt.date.today().isoformat()} on {machine()}.",
        f"Load average before each configuration: {min(loads):.1f}–{max(loads):.1f} "
        "(the machine is shared: times are indicative)."
        if loads
        else "",
        "",
        *preamble(rows, headline),
        f"## Targets ({headline})",
        "",
        *targets(rows, headline),
    ]
    for i, dt in enumerate(dtypes):
        body = [line for table in TABLES for line in section(rows, table, dt)]
        if i and body:
            lines += [f"# Secondary: {dt}", "", f"The paper's tables again, {dt} rows only.", ""]
            lines += [f"## Targets on {dt} rows (secondary; the headline's are above)", ""]
            lines += targets(rows, dt)
        lines += body
    lines += dtype_section(rows)
    lines += bench_ladder.section(rows)
    lines += bench_softmax.section(rows)
    lines += bench_speed.section(rows)
    lines += bench_dpo.section(rows)
    lines += bench_dp.section(rows)
    lines += bench_profile.section(rows)
    lines += bench_dequant.section(rows)
    lines += bench_decode.section(rows)
    lines += dropin_report.section(rows)
    lines += bench_ondevice.section(rows)
    lines += ondevice_cap.section(rows)
    lines += cuda_section(rows)
    for dt in dtypes:
        comp = composition(rows, dt)
        if comp:
            lines += [f"## What makes up MeSP's peak ({dt})", "", *comp]
    if pngs:
        lines += ["## Plots", ""]
        rel = os.path.relpath(out, markdown.parent)
        lines += [f"![{p.stem}]({rel}/{p.name})" for p in pngs] + [""]
    cmds = sorted({r.get("command") for r in rows if r.get("command")})
    lines += ["## Commands", "", *[f"    {c}" for c in cmds], ""]
    markdown.write_text("\n".join(lines))
    return markdown
