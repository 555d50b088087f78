"""`mesp bench dropin`'s BENCHMARKS.md section: every configuration's peak and step time, then
patched / unpatched at the same checkpointing setting against the targets."""

from __future__ import annotations

from typing import Any

from mesp.bench.dropin import CONFIG_NAMES, MEMORY_TARGET, MIB, TIME_TARGET, config_name


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and r.get("status") == "ok"


def _pick(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Of two rows of one configuration: a measured one, a CPU one (it has time) before meta."""
    if old is None or (_ok(new) and not _ok(old)):
        return new
    if _ok(new) and new["config"].get("device", "cpu") == "cpu":
        return new
    return old


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def _met(x: float | None, limit: float) -> str:
    return "not measured" if x is None else ("met" if x <= limit else "MISSED")


def section(rows: list[dict[str, Any]]) -> list[str]:
    """The BENCHMARKS.md section: every configuration's peak and step time, then patched /
    unpatched at the same checkpointing setting against the targets."""
    mine = [r for r in rows if r.get("table") == "dropin"]
    if not mine:
        return []
    out = [
        "## Drop-in: HF + PEFT, unpatched vs `mesp.patch`",
        "",
        "A user's own loop on transformers + PEFT (`model(input_ids=…, labels=…).loss.backward()`, "
        "then AdamW), LoRA r on q,k,v,o,gate,up,down, random weights at the named shape, batch 1. "
        "Four configurations: unpatched or after `mesp.patch(model)`, each with HF gradient "
        "checkpointing (non-reentrant) off and on; each in its own process. Exact peak of one "
        "step (forward, backward, optimizer step) after a warm-up step: working = all live "
        "tensors except the frozen weights and the adapter (params, grads, AdamW state); total "
        "adds those two, and the frozen weights dominate it. Step time: median of untracked "
        "steps, process CPU time (all threads; what to compare on a shared machine) and wall.",
        "",
    ]
    groups = sorted({(r["config"]["shape"], r["config"]["dtype"]) for r in mine})
    for shape, dtype in groups:
        g = [r for r in mine if (r["config"]["shape"], r["config"]["dtype"]) == (shape, dtype)]
        by: dict[tuple[int, str], dict[str, Any]] = {}
        for r in g:
            key = (r["config"]["seq"], config_name(r["config"]))
            by[key] = _pick(by.get(key), r)
        seqs = sorted({r["config"]["seq"] for r in g})
        ok = [r for r in g if _ok(r)]
        c0 = g[0]["config"]
        w = f", frozen weights {ok[0]['exact']['weights'] / MIB:.0f} MiB" if ok else ""
        out += [f"**{shape}, {dtype}, rank {c0['rank']}**{w}.", ""]
        out += [
            "| seq | configuration | working MiB | total MiB | step CPU s | step wall s |",
            "|---|---|---|---|---|---|",
        ]
        for seq in seqs:
            for name in CONFIG_NAMES.values():
                r = by.get((seq, name))
                if r is None:
                    continue
                if r.get("status") != "ok":
                    why = f"{r.get('status')}: {str(r.get('reason', ''))[:80]}"
                    out.append(f"| {seq} | {name} | {why} | | | |")
                    continue
                e = r["exact"]
                t = ["– (meta)"] * 2 if r.get("time_s") is None else [
                    f"{r['cpu_s']:.2f}", f"{r['time_s']:.2f}"]  # fmt: skip
                dev = " (meta)" if r["config"].get("device", "cpu") == "meta" else ""
                out.append(
                    f"| {seq} | {name}{dev} | {e['working'] / MIB:.1f} | {e['total'] / MIB:.1f} | "
                    f"{t[0]} | {t[1]} |"
                )
        out += [
            "",
            f"Patched / unpatched at the same checkpointing setting; targets: memory ≤ "
            f"{MEMORY_TARGET:g}x, step time ≤ {TIME_TARGET:g}x.",
            "",
            "| seq | checkpointing | working | total | step CPU | step wall |",
            "|---|---|---|---|---|---|",
        ]
        for seq in seqs:
            for gc_ in (False, True):
                u = by.get((seq, CONFIG_NAMES[(False, gc_)]))
                p = by.get((seq, CONFIG_NAMES[(True, gc_)]))
                if u is None and p is None:
                    continue
                pair = [r if _ok(r) else None for r in (u, p)]
                cells = []
                for key, limit in (("working", MEMORY_TARGET), ("total", MEMORY_TARGET),
                                   ("cpu_s", TIME_TARGET), ("time_s", TIME_TARGET)):  # fmt: skip
                    x = None
                    if pair[0] and pair[1]:
                        val = [r[key] if key.endswith("_s") else r["exact"][key] for r in pair]
                        x = None if None in val else _ratio(*val)
                    cells.append("–" if x is None else f"{x:.2f} ({_met(x, limit)})")
                out.append(f"| {seq} | {'on' if gc_ else 'off'} | " + " | ".join(cells) + " |")
        out.append("")
    cmds = sorted({r["command"] for r in mine if r.get("command")})
    out += [*(f"Command: `{c}`" for c in cmds), ""]
    return out
