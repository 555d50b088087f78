"""The report's cells: rows indexed by configuration (one dtype at a time), and how a row's
memory, RSS and time read in a table."""

from __future__ import annotations

from typing import Any

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


def index(rows: list[Row], table: str, dtype: str) -> dict[Key, Row]:
    """(shape, seq, rank, variant) -> row. A real (CPU) measurement wins over a meta one of
    the same configuration: it has RSS and time as well as the (equal) exact peak."""
    out: dict[Key, Row] = {}
    for r in rows:
        c = r.get("config", {})  # rows of other benchmarks (decode) may have no config
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


def status(r: Row | None) -> str:
    if r is None:
        return "not run"
    reason = str(r.get("reason", ""))
    return f"{r['status']} ({reason[:60]})" if reason else r["status"]


def cell_mem(r: Row | None) -> str:
    return f"{mem(r):.1f} ({mem(r, 'total'):.1f})" if ok(r) else status(r)


def cell_rss(r: Row | None) -> str:
    if not ok(r):
        return status(r)
    rss = r.get("rss")  # type: ignore[union-attr]
    if not rss:
        return "– (meta)"
    return f"{rss['step_bytes'] / MiB:.1f} ({rss['peak_bytes'] / MiB:.0f})"


def floor_s(r: Row | None) -> float | None:
    """The row's matmul floor in seconds: 6·N·T at the GEMM rate its time child measured."""
    f = r.get("matmul_floor") if ok(r) else None  # type: ignore[union-attr]
    return f["seconds"] if f else None


def floor_ratio(r: Row | None) -> float | None:
    """Step time / matmul floor: the median over the row's steps of each step against the floor
    at the rate probed right before it; rows timed before per-step probes: median / floor."""
    t = r.get("time") if ok(r) else None  # type: ignore[union-attr]
    if t and "floor_ratios" in t:
        return t["floor_ratio"]
    return ratio(secs(r), floor_s(r))


def cell_time(r: Row | None) -> str:
    """median s (tokens/s), and the matmul floor beside it where the row has one."""
    if not ok(r):
        return status(r)
    if secs(r) is None:
        why = r.get("time_reason")  # type: ignore[union-attr]
        return f"– ({why[:60]})" if why else "– (meta)"
    text = f"{secs(r):.3g} ({r['time']['tokens_per_s']:.3g})"  # type: ignore[index]
    fl = floor_s(r)
    return text if fl is None else f"{text}; floor {fl:.3g}"


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def grid(head: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in body]
