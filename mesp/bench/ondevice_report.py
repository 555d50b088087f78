"""The `mesp bench ondevice` rows as text: the one-line summary of a row and BENCHMARKS.md's
section (the runner's own peak beside the 5 ms outside poll, the per-program breakdown)."""

from __future__ import annotations

from typing import Any

PAPER_MB = 136.2  # MeSP on an iPhone 17 Pro, bf16 LoRA, seq 256 (arXiv 2602.13069)
# the paper's MeSP figures (MB), by (Qwen2.5 shape, seq, rank): its size, sequence and rank tables
PAPER: dict[tuple[str, int, int], float] = {
    ("qwen2.5-0.5b", 256, 8): 136.2,
    ("qwen2.5-1.5b", 256, 8): 262.6,
    ("qwen2.5-3b", 256, 8): 368.4,
    ("qwen2.5-0.5b", 128, 8): 110.7,
    ("qwen2.5-0.5b", 512, 8): 245.8,
    ("qwen2.5-0.5b", 1024, 8): 513.6,
    ("qwen2.5-0.5b", 256, 4): 132.8,
    ("qwen2.5-0.5b", 256, 16): 143.5,
    ("qwen2.5-0.5b", 256, 32): 158.2,
}


def line(r: dict[str, Any]) -> str:
    n, e = r["native"], r["engine"]
    return (
        f"{label(r['config'])}: native {n['median_s']:.2f} s/step, peak anon "
        f"{n['peak_anon_bytes'] / 1e6:.1f} MB{_polled(n)} "
        f"(VmHWM {n['peak_rss_bytes'] / 1e6:.1f} MB); "
        f"engine {e['median_s']:.2f} s/step{_steps(e)}, peak RSS "
        f"{e['peak_rss_bytes'] / 1e6:.1f} MB"
    )


def _steps(e: dict[str, Any]) -> str:
    """' (steps a, b, c; GEMM probe X GFLOP/s)' where the row has them (older rows have not)."""
    if not e.get("steps_s"):
        return ""
    gemm = f"; GEMM probe {e['gemm_gflops']:.0f} GFLOP/s" if e.get("gemm_gflops") else ""
    return f" (steps {', '.join(f'{t:.2f}' for t in e['steps_s'])}{gemm})"


def _polled(n: dict[str, Any]) -> str:
    """', outside 5 ms poll X MB' where the row has it (rows before the poll have not)."""
    if not n.get("polled_peak_anon_bytes"):
        return ""
    ms = n["poll_period_s"] * 1e3
    return f", outside {ms:g} ms poll {n['polled_peak_anon_bytes'] / 1e6:.1f} MB"


def honest(n: dict[str, Any]) -> str:
    """The largest anon figure the row knows (its own, or the outside poll's where higher), MB,
    with a mark where the outside poll read more than the runner reported + 2%."""
    own, polled = n["peak_anon_bytes"], n.get("polled_peak_anon_bytes") or 0
    flag = " (!)" if polled > 1.02 * own else ""
    return f"{max(own, polled) / 1e6:.1f}{flag}"


def section(rows: list[dict[str, Any]]) -> list[str]:
    ok = [r for r in rows if r.get("table") == "ondevice" and r.get("status") == "ok"]
    if not ok:
        return []
    lines = [
        "## On the device: the native ExecuTorch runner",
        "",
        "`mesp export --target executorch` programs trained by build/ondevice/mesp-runner "
        "(C++, no Python, no libtorch), SGD, beside the in-process mesp engine on the same "
        "configuration (fp32, every block recomputed). Peak anon = the largest RssAnon the "
        "runner reported (anonymous memory, the analogue of iOS phys_footprint; a thread of the "
        "runner reads it every 1 ms); outside poll = the largest RssAnon read from "
        "/proc/PID/status every 5 ms by the benchmark (the figure to trust: (!) marks a row "
        "whose poll read more than the runner's own + 2%; rows before the poll have none). "
        "VmHWM also counts the mapped weight files and libraries. Times: median of the steps "
        "after the first.",
        "",
        "| shape | seq | bits | native s/step | engine s/step | native / engine | peak anon MB "
        f"| outside poll MB | vs paper {PAPER_MB} MB | native VmHWM MB | engine peak RSS MB "
        "| largest planned MB | CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ok:
        c, n, e = r["config"], r["native"], r["engine"]
        anon = max(n["peak_anon_bytes"], n.get("polled_peak_anon_bytes") or 0) / 1e6
        polled = n.get("polled_peak_anon_bytes")
        big = max(n["planned_bytes"].items(), key=lambda kv: kv[1])
        lines.append(
            f"| {label(c)} | {c['seq']} | {'stored' if c.get('model') else c['bits']} | "
            f"{n['median_s']:.2f} | "
            f"{e['median_s']:.2f} | {n['median_s'] / e['median_s']:.2f} | "
            f"{n['peak_anon_bytes'] / 1e6:.1f} | "
            f"{honest(n) if polled else 'not polled'} | "
            f"{anon / PAPER_MB:.2f}x | {n['peak_rss_bytes'] / 1e6:.1f} | "
            f"{e['peak_rss_bytes'] / 1e6:.1f} | {big[1] / 1e6:.1f} ({big[0]}) | "
            f"{r.get('cpu', 'not recorded')} |"
        )
    lines.append("")
    # the breakdown of the newest real-model row (else the first): what each program adds
    real = [r for r in ok if r["config"].get("model")]
    for r in real[-1:] or ok[:1]:
        planned = ", ".join(
            f"{k} {v / 1e6:.1f}" for k, v in sorted(r["native"]["planned_bytes"].items())
        )
        seen = [
            f"{e['at'].removeprefix('after first ')} {e['rss_anon_bytes'] / 2**20:.1f}"
            + (
                f" (inside {e['peak_inside_bytes'] / 2**20:.1f})"
                if e.get("peak_inside_bytes")
                else ""
            )
            for e in r["native"].get("memory_events", [])
            if not e["at"].startswith("before")
        ]
        lines.append(f"Planned memory per program (MB), {label(r['config'])}: {planned}.")
        spent = r["native"].get("program_s")  # rows of runners before it: none
        if spent:
            each = ", ".join(f"{k} {v:.2f}" for k, v in sorted(spent.items()))
            lines.append(
                f"Runner seconds per program in a step (median; the rest of the step's "
                f"{r['native']['median_s']:.2f} s is outside the programs): {each}."
            )
        if seen:
            lines.append(f"Runner RssAnon (MiB) at each point of step 1: {', '.join(seen)}.")
    lines += dp_lines(ok) + paper_table(ok)
    lines += [
        "Targets (issue 37): peak anon ≤ 100 MB polled from outside with the default export "
        f"(the paper: {PAPER_MB} MB), native step ≤ 1.0× the engine's (both measured in one run, "
        "alone on the machine).",
        "",
    ]
    return lines


def paper_table(ok: list[dict[str, Any]]) -> list[str]:
    """The paper's size / sequence / rank cells beside the runner's on the same configuration
    (random 4-bit weights at the Qwen2.5 shapes, default export; the newest row of each)."""
    mine: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in ok:
        c = r["config"]
        special = ("model", "weight_block_kb", "checkpoints_on_disk", "dp")
        plain = not any(c.get(k) for k in special) and c.get("checkpoint_dtype") in (
            None,
            "float32",
        )
        key = (c["shape"], c["seq"], c.get("rank", 8))
        if plain and key in PAPER:
            mine[key] = r
    if not mine:
        return []
    lines = [
        "The paper's MeSP table (iPhone 17 Pro, bf16, phys_footprint every 0.5 s) beside the "
        "runner (fp32, 4-bit random weights at the same shapes, outside 5 ms poll):",
        "",
        "| Qwen2.5 | seq | rank | paper MB | runner peak anon MB | runner / paper "
        "| native / engine | CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, paper in PAPER.items():
        if key not in mine:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {paper} | not run | | | |")
            continue
        r = mine[key]
        n, e = r["native"], r["engine"]
        anon = max(n["peak_anon_bytes"], n.get("polled_peak_anon_bytes") or 0) / 1e6
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {paper} | {honest(n)} | {anon / paper:.2f}x | "
            f"{n['median_s'] / e['median_s']:.2f} | {r.get('cpu', 'not recorded')} |"
        )
    return [*lines, ""]


def dp_lines(ok: list[dict[str, Any]]) -> list[str]:
    """DP-SGD rows against the plain native run measured beside them."""
    dp = [r for r in ok if r.get("plain")]
    if not dp:
        return []
    out = []
    for r in dp:
        n, p = r["native"], r["plain"]
        peak = lambda x: max(x["peak_anon_bytes"], x.get("polled_peak_anon_bytes") or 0)  # noqa: E731
        diff = r.get("adapter_vs_plain")
        out.append(
            f"- {label(r['config'])}: peak anon {peak(n) / 1e6:.1f} MB against "
            f"{peak(p) / 1e6:.1f} MB plain ({peak(n) / peak(p):.2f}x), "
            f"{n['median_s']:.2f} s/step against {p['median_s']:.2f} "
            f"({n['median_s'] / p['median_s']:.2f}x)"
            + (f", adapter {diff:.1e} of its training move from plain's" if diff else "")
            + f", {r.get('cpu', 'not recorded')}"
        )
    return [
        "Variants on the runner beside the plain run of the same command (DP-SGD: C 1, σ 1, "
        "every row each step, one row at a time; block inputs in half precision):",
        "",
        *out,
        "",
    ]


def label(c: dict[str, Any]) -> str:
    kb = c.get("weight_block_kb", 0)
    what = f"{c['model']} (real)" if c.get("model") else c["shape"]
    shape = what + (f" rank {c['rank']}" if c.get("rank", 8) != 8 else "")
    shape += f" ({kb} KiB weight blocks)" if kb else ""
    shape += " (block inputs on disk)" if c.get("checkpoints_on_disk") else ""
    ck = c.get("checkpoint_dtype", "float32")
    shape += f" (block inputs in {ck})" if ck != "float32" else ""
    return shape + (f" DP-SGD {c['dp']}" if c.get("dp") else "")
