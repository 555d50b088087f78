"""BENCHMARKS.md and its plots, rebuilt from every JSON row under OUT/rows.

Memory in MiB. "working" is every byte live at the exact peak that is neither a frozen weight
nor adapter (params + grads + optimizer state); "total" adds those two. The paper's numbers
(iPhone phys_footprint, weights streamed from disk) sit beside ours for orientation only.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any

from mesp.bench import decode as bench_decode
from mesp.bench import dequant as bench_dequant
from mesp.bench import dropin as dropin_bench
from mesp.bench import ladder as bench_ladder
from mesp.bench import ondevice as bench_ondevice
from mesp.bench import softmax as bench_softmax
from mesp.bench.output import load_rows, pyplot
from mesp.bench.tables import TABLES

MiB = 2**20
Row = dict[str, Any]
Key = tuple[str, int, int, str]  # shape, seq, rank, variant
LABELS = {
    "peft-gc": "peft+gc",
    "mesp-fp": "mesp unquant.",
    "mesp-store": "mesp store-h",
    "mesp-disk": "mesp + disk ckpt",
    "mesp-stream": "mesp + disk ckpt + streamed weights",
    "mesp-budget": "mesp, every tape kept",
}
# FACTS.md, from the paper (iPhone 17 Pro): MeBP MB, s, MeSP MB, s.
PAPER_T1 = {
    "qwen2.5-0.5b": (360.8, 0.68, 136.2, 0.86),
    "qwen2.5-1.5b": (516.2, 1.66, 262.6, 2.17),
    "qwen2.5-3b": (637.6, 3.21, 368.4, 4.09),
}
PAPER_SEQ = {128: (252.7, 110.7), 256: (360.8, 136.2), 512: (582.4, 245.8), 1024: (1050.3, 513.6)}
PAPER_RANK = {4: 132.8, 8: 136.2, 16: 143.5, 32: 158.2}
PAPER_H = {"mesp-store": (398.5, 3.85), "mesp": (368.4, 4.09)}


def index(rows: list[Row], table: str, dtype: str) -> dict[Key, Row]:
    """(shape, seq, rank, variant) -> row. A real (CPU) measurement wins over a meta one of
    the same configuration: it has RSS and time as well as the (equal) exact peak."""
    out: dict[Key, Row] = {}
    for r in rows:
        c = r.get("config", {})
        if r.get("table") == table and c["dtype"] == dtype:
            k = (c["shape"], c["seq"], c["rank"], c["variant"])
            old = out.get(k)
            if old is None or not ok(old) or (ok(r) and c.get("device", "cpu") == "cpu"):
                out[k] = r
    return out


def ok(r: Row | None) -> bool:
    return r is not None and r.get("status") == "ok"


def mem(r: Row | None, part: str = "working") -> float | None:
    return r["exact"][part] / MiB if ok(r) else None  # type: ignore[index]


def secs(r: Row | None) -> float | None:
    return r["time"]["median_s"] if ok(r) and r.get("time") else None  # type: ignore[union-attr]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _status(r: Row | None) -> str:
    if r is None:
        return "not run"
    reason = str(r.get("reason", ""))
    return f"{r['status']} ({reason[:60]})" if reason else r["status"]


def cell_mem(r: Row | None) -> str:
    return f"{mem(r):.1f} ({mem(r, 'total'):.1f})" if ok(r) else _status(r)


def cell_rss(r: Row | None) -> str:
    if not ok(r):
        return _status(r)
    rss = r.get("rss")  # type: ignore[union-attr]
    if not rss:
        return "– (meta)"
    return f"{rss['step_bytes'] / MiB:.1f} ({rss['peak_bytes'] / MiB:.0f})"


def cell_time(r: Row | None) -> str:
    if not ok(r):
        return _status(r)
    if secs(r) is None:
        return "– (meta)"
    return f"{secs(r):.3g} ({r['time']['tokens_per_s']:.3g})"  # type: ignore[index]


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _grid(head: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in body]


def _variants(idx: dict[Key, Row]) -> list[str]:
    order = ("bp", "mebp", "mesp", "mesp-store", "mezo", "peft-gc", "mesp-fp")
    order += ("mesp-disk", "mesp-stream", "mesp-budget")
    seen = {k[3] for k in idx}
    return [v for v in order if v in seen]


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
    var = _variants(idx)
    cols = [LABELS.get(v, v) for v in var]
    axis = {"table2": 1, "table3": 2}.get(table, 0)  # which config field the rows vary over
    keys = sorted({k[:3] for k in idx}, key=lambda k: (k[0], k[1], k[2]))
    shapes = {k[0] for k in keys}
    name = {0: "model", 1: "seq", 2: "rank"}[axis]
    any_c = next(iter(idx.values()))["config"]
    q = f"{any_c['bits']}-bit g{any_c['group_size']}" if any_c["bits"] else "unquantized"
    out = [
        f"## {TABLES[table].title}",
        "",
        f"{dtype}, batch 1, SGD; base {q} except peft+gc "
        "and mesp unquant. (bf16 base). Cells: working MiB (total MiB) of the exact peak; "
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
        time_rows.append([label, *map(cell_time, rs), fmt(tr)])
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
    out += ["", "Time per step: median s (tokens/s).", ""]
    last = {"offload": "streamed / mesp time", "budget": "every tape kept / bp tokens/s"}.get(
        table, "mesp/mebp time"
    )
    out += _grid([name, *cols, last], time_rows)
    return out + [""]


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


def targets(rows: list[Row]) -> list[str]:
    """The acceptance targets (bf16), each with the measured figure."""
    real = [r for r in rows if not r.get("quick")]  # tiny --quick shapes are not targets
    t1, t2 = index(real, "table1", "bfloat16"), index(real, "table2", "bfloat16")
    body: list[list[str]] = []
    notes: list[str] = []

    def add(what: str, value: float | None, limit: float, le: bool = True) -> None:
        met = value is not None and (value <= limit if le else value >= limit)
        status = "not measured" if value is None else ("met" if met else "MISSED")
        body.append([what, fmt(value), f"{'≤' if le else '≥'} {limit:g}", status])

    for (shape, seq, rank, v), r in sorted(t1.items()):
        if v != "mesp":
            continue
        mebp, peft = t1.get((shape, seq, rank, "mebp")), t1.get((shape, seq, rank, "peft-gc"))
        add(f"{shape}: mesp / mebp working", ratio(mem(r), mem(mebp)), 0.30)
        add(f"{shape}: mesp / peft+gc total", ratio(mem(r, "total"), mem(peft, "total")), 0.20)
        fp = t1.get((shape, seq, rank, "mesp-fp"))  # like for like: both bases unquantized
        add(
            f"{shape}: mesp unquant. / peft+gc total",
            ratio(mem(fp, "total"), mem(peft, "total")),
            0.20,
        )
        st = t1.get((shape, seq, rank, "mesp-stream"))  # + weights streamed from disk
        add(
            f"{shape}: mesp streamed weights / peft+gc total",
            ratio(mem(st, "total"), mem(peft, "total")),
            0.20,
        )
        add(f"{shape}: mesp / mebp step time", ratio(secs(r), secs(mebp)), 1.10)
        tps = ratio(secs(peft), secs(r))  # = mesp tokens/s over peft tokens/s
        add(f"{shape}: mesp / peft+gc tokens/s", tps, 1.0, le=False)
        add(f"{shape}: mesp unquant. / peft+gc tokens/s", ratio(secs(peft), secs(fp)), 1.0, False)
        notes += _bounds(shape, r, fp, peft)
    s = {k[1]: r for k, r in t2.items() if k[3] == "mesp"}
    add("mesp working, seq 4096 / seq 1024", ratio(mem(s.get(4096)), mem(s.get(1024))), 4.4)
    return _grid(["target", "measured", "goal", ""], body) + ["", *notes, ""]


def _bounds(shape: str, r: Row, fp: Row | None, peft: Row | None) -> list[str]:
    """What bounds the PEFT comparisons, from the same rows."""
    if not (ok(r) and ok(peft)):
        return []
    w, tot, pt = mem(r, "weights"), mem(r, "total"), mem(peft, "total")
    out = [
        f"- {shape}, total vs peft+gc: the frozen weights bound it. mesp holds {w:.0f} of its "
        f"{tot:.0f} MiB in 4-bit weights (working {mem(r):.0f} MiB against peft+gc's "
        f"{mem(peft):.0f}); at bf16, weights alone are {mem(fp, 'weights') or 0:.0f} of "
        f"peft+gc's {pt:.0f} MiB, so no engine gets under {(mem(fp, 'weights') or 0) / pt:.2f} "
        "without taking the weights out of memory, which `--stream-weights` does (row above)."
    ]
    if secs(r) and secs(peft) and secs(fp):
        out.append(
            f"- {shape}, speed vs peft+gc: mesp on the 4-bit base dequantizes every weight three "
            "times a step (forward, recompute, backward), where peft+gc multiplies by its bf16 "
            f"weights directly; on the same bf16 base mesp runs at "
            f"{secs(peft) / secs(fp):.2f}x peft+gc's tokens/s."  # type: ignore[operator]
        )
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
    body = []
    for k, by in sorted(timed.items()):
        f32, b16 = by.get("float32"), by.get("bfloat16")
        if f32 is None or b16 is None:
            continue
        t, v, shape, seq, rank = k
        label = f"{LABELS.get(v, v)}, {shape} s{seq} r{rank} ({t})"
        path = str(b16.get("matmul", "–")).split(" (")[0]
        row = [label, cell_time(f32), cell_time(b16), fmt(ratio(secs(b16), secs(f32))), path]
        body.append(row)
    if not body:
        return []
    head = ["configuration", "fp32 s (tokens/s)", "bf16 s (tokens/s)", "bf16 / fp32", "bf16 path"]
    out = ["## bf16 against fp32", "", "Median step time of the same configuration in both "]
    out[-1] += "dtypes (issue 17's target: bf16 within 1.15x of fp32)."
    return [*out, "", *_grid(head, body), ""]


def _matmul_note(rows: list[Row]) -> str:
    if not any(str(r.get("matmul", "")).startswith("fp32") for r in rows):
        return ""
    return (
        "This CPU has no native bf16 GEMM (torch's fallback is 5-160x slower than fp32), so "
        "mesp computes every bf16 matmul in fp32 and rounds the result once (bf16 storage, "
        "what a native bf16 kernel computes; mesp/ops/matmul.py): the rows time the path "
        "`mesp train --dtype bfloat16` runs, and the exact peak counts its transient fp32 "
        "copies (large operands upcast in blocks of about 4 MiB). The PEFT baseline's bf16 "
        "matmuls get the same fp32 GEMM through a benchmark-only substitute, so both sides time "
        "the same kernel."
    )


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def plot_memory_vs_seq(rows: list[Row], path: Path, dtype: str) -> Path | None:
    """Working memory against sequence length, one line per engine, paper points beside."""
    idx = {k: r for k, r in index(rows, "table2", dtype).items() if ok(r)}
    if not idx:
        return None
    # One model per plot: the paper's 0.5B when measured, else the first measured shape.
    shape = "qwen2.5-0.5b" if any(k[0] == "qwen2.5-0.5b" for k in idx) else min(idx)[0]
    idx = {k: r for k, r in idx.items() if k[0] == shape}
    if len({k[1] for k in idx}) < 2:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in _variants(idx):
        pts = sorted((k[1], mem(r)) for k, r in idx.items() if k[3] == v)
        label = f"{LABELS.get(v, v)} (working, measured)"
        ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ticks = {k[1] for k in idx}
    for i, name in enumerate(("MeBP", "MeSP") if shape == "qwen2.5-0.5b" else ()):
        xs = sorted(PAPER_SEQ)
        ticks |= set(xs)
        ax.plot(
            xs,
            [PAPER_SEQ[x][i] for x in xs],
            ls="--",
            marker="x",
            color="grey" if i else "k",
            label=f"paper {name} (iPhone phys_footprint, total)",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length (tokens)",
        ylabel="MiB",
        title=f"Peak memory vs sequence length, {shape}, {dtype}",
    )
    ax.set_xticks(sorted(ticks), [str(x) for x in sorted(ticks)])
    ax.minorticks_off()
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(rows: list[Row], path: Path, dtype: str) -> Path | None:
    """Live working bytes after every op of one step, mebp against mesp: where MeSP saves."""
    for table in ("table1", "table2", "table3"):
        idx = index(rows, table, dtype)
        for k in sorted({k[:3] for k in idx}):
            pair = [idx.get((*k, v)) for v in ("mebp", "mesp")]
            if all(ok(r) and r.get("timeline") for r in pair):
                break
        else:
            continue
        break
    else:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    peaks = {}
    for v, r in zip(("mebp", "mesp"), pair, strict=True):
        ys = [y / MiB for y in r["timeline"]]  # type: ignore[index]
        xs = [i / max(1, len(ys) - 1) for i in range(len(ys))]
        peaks[v] = peak = max(ys)
        for ax in axes:
            ax.plot(xs, ys, lw=0.8, label=f"{v}: peak {peak:.1f} MiB")
            ax.annotate(f"{peak:.1f}", (xs[ys.index(peak)], peak), fontsize=7)
    # The lower panel zooms to mesp's scale: the per-block backward peaks of both engines.
    axes[1].set_ylim(0, 1.3 * max(peaks["mesp"], 1e-3))
    axes[0].set_title(f"Memory over one step, {k[0]}, seq {k[1]}, rank {k[2]}, {dtype}")
    axes[1].set_title("same, zoomed to mesp's peak", fontsize=9)
    axes[1].set_xlabel("fraction of the step's ops (forward, then backward block by block)")
    for ax in axes:
        ax.set_ylabel("live MiB above weights + adapter params", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_time(rows: list[Row], path: Path, dtype: str) -> Path | None:
    """Seconds per step per engine, grouped by model (table 1)."""
    idx = {k: r for k, r in index(rows, "table1", dtype).items() if ok(r)}
    if not idx:
        return None
    plt = pyplot()
    shapes, var = sorted({k[0] for k in idx}), _variants(idx)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(var)
    for j, v in enumerate(var):
        ys = [
            secs(next((r for k, r in idx.items() if k[0] == s and k[3] == v), None)) or 0
            for s in shapes
        ]
        ax.bar([i + j * width for i in range(len(shapes))], ys, width, label=LABELS.get(v, v))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes)
    ax.set(ylabel="seconds per step (median)", title=f"Time per step, {dtype}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(rows: list[Row], out: Path, dtype: str) -> list[Path]:
    made = [
        plot_memory_vs_seq(rows, out / "memory_vs_seq.png", dtype),
        plot_timeline(rows, out / "timeline.png", dtype),
        plot_time(rows, out / "time_per_step.png", dtype),
        bench_ladder.plot(rows, out / "ladder.png"),
    ]
    return [p for p in made if p is not None]


def write_report(out: Path, markdown: Path, dtype: str = "bfloat16") -> Path:
    """Plots into OUT, then MARKDOWN from every row under OUT (the tables that exist)."""
    rows = load_rows(out)
    pngs = make_plots(rows, out, dtype)
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
        "Each configuration runs in its own process (glibc set to return every free to the "
        "kernel): random weights of the named shape, LoRA rank r on q,k,v,o,gate,up,down, one "
        "random sequence, all tokens trained, warm-up step(s) first. Exact peak: every live "
        "tensor storage during one step (engine step + SGD step). RSS: VmHWM reset right "
        "before a step. Time: median of untracked steps. Rows marked '(meta)' were measured "
        "on PyTorch's meta device (`--device meta`): the same code on shapes and dtypes "
        "without arithmetic, so their exact peak is what a CPU run holds (tested rung by rung "
        "in tests/test_bench_ladder.py) but they have no RSS and no time; a CPU row of the "
        "same configuration takes precedence.",
        "",
        _matmul_note(rows),
        "",
        "## Targets (bf16)",
        "",
        *targets(rows),
    ]
    for table in TABLES:
        lines += section(rows, table, dtype)
    lines += dtype_section(rows)
    lines += bench_ladder.section(rows)
    lines += bench_softmax.section(rows)
    lines += bench_dequant.section(rows)
    lines += bench_decode.section(rows)
    lines += dropin_bench.section(rows)
    lines += bench_ondevice.section(rows)
    comp = composition(rows, dtype)
    if comp:
        lines += ["## What makes up MeSP's peak", "", *comp]
    if pngs:
        lines += ["## Plots", ""]
        rel = os.path.relpath(out, markdown.parent)
        lines += [f"![{p.stem}]({rel}/{p.name})" for p in pngs] + [""]
    cmds = sorted({r.get("command") for r in rows if r.get("command")})
    lines += ["## Commands", "", *[f"    {c}" for c in cmds], ""]
    markdown.write_text("\n".join(lines))
    return markdown
