"""The report's plots, one dtype each (named in the title), files only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mesp.bench import ladder as bench_ladder
from mesp.bench.cells import LABELS, Key, MiB, Row, index, mem, ok, secs
from mesp.bench.output import pyplot

PAPER_SEQ = {128: (252.7, 110.7), 256: (360.8, 136.2), 512: (582.4, 245.8), 1024: (1050.3, 513.6)}


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write and close a finished figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def variants(idx: dict[Key, Row]) -> list[str]:
    order = ("bp", "mebp", "mesp", "mesp-store", "mezo", "peft-gc", "mesp-fp")
    order += ("mesp-disk", "mesp-stream", "mesp-budget")
    seen = {k[3] for k in idx}
    return [v for v in order if v in seen]


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
    for v in variants(idx):
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
    return _save(plt, fig, path)


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
    return _save(plt, fig, path)


def plot_time(rows: list[Row], path: Path, dtype: str) -> Path | None:
    """Seconds per step per engine, grouped by model (table 1)."""
    idx = {k: r for k, r in index(rows, "table1", dtype).items() if ok(r)}
    if not idx:
        return None
    plt = pyplot()
    shapes, var = sorted({k[0] for k in idx}), variants(idx)
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
    return _save(plt, fig, path)


def make_plots(rows: list[Row], out: Path, dtypes: list[str]) -> list[Path]:
    """Each plot in the first of `dtypes` (headline first) that has its rows; one dtype per
    plot, named in its title."""

    def first(plot, name: str) -> Path | None:  # type: ignore[no-untyped-def]
        return next((p for d in dtypes if (p := plot(rows, out / name, d))), None)

    made = [
        first(plot_memory_vs_seq, "memory_vs_seq.png"),
        first(plot_timeline, "timeline.png"),
        first(plot_time, "time_per_step.png"),
        bench_ladder.plot(rows, out / "ladder.png"),
    ]
    return [p for p in made if p is not None]
