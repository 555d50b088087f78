"""The acceptance targets, each with the figure measured, evaluated on one dtype's rows: the
headline dtype, fp32 where the CPU has no native bf16 GEMM (mesp.ops.matmul's own check), since
a bf16 step there times a substitute and not the kernel a bf16 CPU would run. A missed target
says by how much and what bounds it, from the same rows."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mesp.bench.cells import Key, Row, floor_ratio, floor_s, fmt, grid, index, mem, ok, ratio, secs
from mesp.bench.speed import best_pair, best_variant
from mesp.ops import matmul as matmul_ops

FLOOR_GOAL = 1.15  # mesp step / matmul floor
PEFT_RECOMPUTE_GOAL = 1.05  # mesp 4-bit tokens/s / peft+gc, every block recomputed
PEFT_KEPT_GOAL = 1.3  # mesp under a budget that keeps tapes (item 4), tokens/s / peft+gc
BUDGET_BP_GOAL = 0.95  # mesp keeping every tape (a generous budget), tokens/s / bp's
BF16_GOAL = 1.15  # bf16 step time / fp32 on a CPU without a bf16 GEMM (computed in fp32)
HEADLINE_CONFIG = ("qwen2.5-0.5b", 256, 8)  # shape, seq, rank of table 1's headline row


def cpu_dtype() -> str:
    """The headline dtype of this CPU: bfloat16 with a native bf16 GEMM, else float32."""
    return "bfloat16" if matmul_ops.native_kernel(torch.bfloat16) else "float32"


def headline_dtype(rows: Iterable[Row]) -> str:
    """fp32 if any row was measured on a CPU without a native bf16 GEMM (rows record it as
    `bf16_gemm`); rows older than that record: this CPU's own answer."""
    flags = [r["bf16_gemm"] for r in rows if "bf16_gemm" in r]
    if flags:
        return "bfloat16" if all(flags) else "float32"
    return cpu_dtype()


def _gap(value: float, limit: float, le: bool) -> str:
    if le:
        return f"{value / limit - 1:.0%} over"
    return f"{1 - value / limit:.0%} short"


class _Table:
    def __init__(self) -> None:
        self.body: list[list[str]] = []

    def add(self, what: str, value: float | None, limit: float, le: bool = True) -> bool:
        """One target row; True when it was measured and missed."""
        met = value is not None and (value <= limit if le else value >= limit)
        status = "not measured" if value is None else ("met" if met else "MISSED")
        gap = "–" if value is None or met else _gap(value, limit, le)
        self.body.append([what, fmt(value), f"{'≤' if le else '≥'} {limit:g}", status, gap])
        return value is not None and not met


def targets(rows: list[Row], dtype: str) -> list[str]:
    """The targets table on `dtype`'s rows (never a mix), then what bounds each miss."""
    real = [r for r in rows if not r.get("quick")]  # tiny --quick shapes are not targets
    t1, t2 = index(real, "table1", dtype), index(real, "table2", dtype)
    budget = index(real, "budget", dtype)
    speed: dict[tuple[str, int, int], list[Row]] = {}  # the product's own bf16 path (auto)
    bf16_on_fp32: dict[tuple[str, int, int], list[Row]] = {}  # bf16 computed in fp32 (item 1)
    for r in real:
        c = r.get("config", {})
        if r.get("table") != "speed" or not ok(r) or c["dtype"] != dtype:
            continue
        k, m = (c["shape"], c["seq"], c["rank"]), c.get("matmul", "auto")
        if m == "auto":
            speed.setdefault(k, []).append(r)
        if m == "fp32" or (m == "auto" and r.get("bf16_gemm") is False):
            bf16_on_fp32.setdefault(k, []).append(r)
    t, notes = _Table(), []
    # table 1's headline configuration is always listed: "not measured" until its rows exist
    keys = {k[:3] for k in t1 if k[3] == "mesp"} | {HEADLINE_CONFIG}
    for shape, seq, rank in sorted(keys):
        r = t1.get((shape, seq, rank, "mesp"))

        def at(variant: str, shape: str = shape, seq: int = seq, rank: int = rank) -> Row | None:
            k: Key = (shape, seq, rank, variant)
            return t1.get(k) or budget.get(k)

        mebp, peft, fp, st, kept = map(
            at, ("mebp", "peft-gc", "mesp-fp", "mesp-stream", "mesp-budget")
        )
        t.add(f"{shape}: mesp / mebp working", ratio(mem(r), mem(mebp)), 0.30)
        t.add(f"{shape}: mesp / peft+gc total", ratio(mem(r, "total"), mem(peft, "total")), 0.20)
        # like for like: both bases unquantized
        t.add(
            f"{shape}: mesp unquant. / peft+gc total",
            ratio(mem(fp, "total"), mem(peft, "total")),
            0.20,
        )
        t.add(
            f"{shape}: mesp streamed weights / peft+gc total",
            ratio(mem(st, "total"), mem(peft, "total")),
            0.20,
        )
        sp = speed.get((shape, seq, rank))
        if sp:  # side by side in one process: the time targets come from there
            notes += speed_targets(t, shape, sp, bf16_on_fp32.get((shape, seq, rank), []))
        else:
            t.add(f"{shape}: mesp / mebp step time", ratio(secs(r), secs(mebp)), 1.10)
            if t.add(f"{shape}: mesp step / matmul floor", floor_ratio(r), FLOOR_GOAL):
                notes.append(_floor_note(shape, r, fp))
            tps = ratio(secs(peft), secs(r))  # = mesp tokens/s over peft tokens/s
            what = f"{shape}: mesp 4-bit / peft+gc tokens/s (all blocks recomputed)"
            if t.add(what, tps, PEFT_RECOMPUTE_GOAL, le=False):
                notes.append(_peft_note(shape, tps, r, fp, peft))
            what = f"{shape}: mesp with budget (kept tapes) / peft+gc tokens/s"
            kept_tps = ratio(secs(peft), secs(kept))
            if t.add(what, kept_tps, PEFT_KEPT_GOAL, le=False):
                notes.append(_kept_note(shape, kept_tps, r, kept))
            what = f"{shape}: mesp unquant. / peft+gc tokens/s"
            t.add(what, ratio(secs(peft), secs(fp)), 1.0, False)
        notes += _bounds(shape, r, fp, peft)
    s = {k[1]: r for k, r in t2.items() if k[3] == "mesp"}
    t.add("mesp working, seq 4096 / seq 1024", ratio(mem(s.get(4096)), mem(s.get(1024))), 4.4)
    return grid(["target", "measured", "goal", "", "missed by"], t.body) + ["", *notes, ""]


def speed_targets(t: _Table, shape: str, sp: list[Row], bf: list[Row]) -> list[str]:
    """The time targets from `mesp bench speed` rows (each pair from the row that has both
    variants and the most rounds): each ratio taken inside a round (steps seconds apart), the
    median over rounds; the notes say what bounds a miss. bf: rows whose bf16 matmuls ran in
    fp32 (the bf16 target is about CPUs without a bf16 GEMM; `--matmul fp32` forces that path
    on one that has it)."""
    notes: list[str] = []
    side = " (side by side)"
    t.add(f"{shape}: mesp / mebp step time{side}", best_pair(sp, "mesp", "mebp"), 1.10)
    got = best_variant(sp, "mesp")
    fr = None if got is None else got[1]["floor_ratio"]
    if t.add(f"{shape}: mesp step / matmul floor{side}", fr, FLOOR_GOAL) and got is not None:
        row, mesp = got
        fp = row["variants"].get(f"mesp-fp:{row['config']['dtype']}")
        notes.append(
            f"- {shape}, mesp step / matmul floor: {fr:.2f}x against ≤ {FLOOR_GOAL:g}, over by "
            f"{fr / FLOOR_GOAL - 1:.0%} (median over {row['config']['rounds']} rounds, each step "
            f"against the rate probed at the start of its round; rounds ranged "
            f"{min(mesp['floor_ratios']):.2f}–{max(mesp['floor_ratios']):.2f})"
            + ("." if fp is None else f"; the same engine on the unquantized base: "
               f"{fp['floor_ratio']:.2f}x, so the rest is outside dequantization: attention, "
               "LoRA's rank-r products, norms, RoPE, activations and the CE (`mesp bench "
               "profile` splits a step by kind).")
        )  # fmt: skip
    tps = best_pair(sp, "peft-gc", "mesp")  # peft's time / mesp's: mesp's tokens/s over peft's
    what = f"{shape}: mesp 4-bit / peft+gc tokens/s (all blocks recomputed){side}"
    if t.add(what, tps, PEFT_RECOMPUTE_GOAL, le=False):
        fp_tps = best_pair(sp, "peft-gc", "mesp-fp")
        notes.append(
            f"- {shape}, mesp 4-bit / peft+gc tokens/s: {tps:.2f} against ≥ "
            f"{PEFT_RECOMPUTE_GOAL:g}"
            + ("." if fp_tps is None else f"; on the unquantized base {fp_tps:.2f}x.")
        )
    what = f"{shape}: mesp with budget (kept tapes) / peft+gc tokens/s{side}"
    t.add(what, best_pair(sp, "peft-gc", "mesp-budget"), PEFT_KEPT_GOAL, le=False)
    what = f"{shape}: mesp with budget (kept tapes) / bp tokens/s{side}"
    t.add(what, best_pair(sp, "bp", "mesp-budget"), BUDGET_BP_GOAL, le=False)
    what = f"{shape}: mesp unquant. / peft+gc tokens/s{side}"
    t.add(what, best_pair(sp, "peft-gc", "mesp-fp"), 1.0, False)
    for variant, label in (("mesp", "4-bit base"), ("mesp-fp", "bf16 base")):
        x = best_pair(bf, f"{variant}:bfloat16", f"{variant}:float32")
        what = f"{shape}: bf16 (computed in fp32) / fp32 step time, {label}{side}"
        t.add(what, x, BF16_GOAL)
    return notes


def _floor_note(shape: str, r: Row, fp: Row | None) -> str:
    x, step, fl = floor_ratio(r), secs(r), floor_s(r)
    g = r["gemm"]
    text = (
        f"- {shape}, mesp step / matmul floor: {x:.2f}x against ≤ {FLOOR_GOAL:g}, missed by "
        f"{x / FLOOR_GOAL - 1:.0%}. At the probed {g['gflops']:.0f} GFLOP/s ({g['dtype']}) the "
        f"6·N·T GEMMs take {fl:.3g} s of the {step:.3g} s step ({1 / x:.0%}); the other "
        f"{step - fl:.3g} s is work outside them"
    )
    per_step = r["time"].get("floor_ratios")
    if per_step:  # each step against the rate probed right before it
        text = text.replace("At the probed", "At the median probed", 1) + (
            f" (the {len(per_step)} steps' own ratios: {min(per_step):.2f}–{max(per_step):.2f})"
        )
    y = floor_ratio(fp)
    if y is None:
        return text + " (dequantization, attention, LoRA, norms, CE, GEMMs below the probe rate)."
    rates = r["gemm"]["gflops"], fp["gemm"]["gflops"]  # type: ignore[index]
    return text + (
        f": on the unquantized base mesp's step is {y:.2f}x its floor, so dequantizing the 4-bit "
        f"weights (forward, recompute, backward) holds about {(x - y) * fl:.3g} s measured "
        f"against each row's own floor ({secs(r) - secs(fp):.3g} s of raw step time, with GEMM "  # type: ignore[operator]
        f"rates probed at {rates[0]:.0f} and {rates[1]:.0f} GFLOP/s in the two children), and "
        f"attention, LoRA, norms, CE and GEMMs below the probe rate the remaining "
        f"{(y - 1) * fl:.3g} s."
    )


def _peft_note(shape: str, tps: float, r: Row, fp: Row | None, peft: Row | None) -> str:
    text = (
        f"- {shape}, mesp 4-bit / peft+gc tokens/s: {tps:.2f} against ≥ {PEFT_RECOMPUTE_GOAL:g}, "
        f"short by {1 - tps / PEFT_RECOMPUTE_GOAL:.0%}."
    )
    fp_tps = ratio(secs(peft), secs(fp))
    if fp_tps is not None:
        text += (
            f" On the unquantized base mesp runs at {fp_tps:.2f}x peft+gc, so the 4-bit "
            f"base's dequantization costs {1 - tps / fp_tps:.0%} of mesp's tokens/s."
        )
    pr = floor_ratio(peft)
    if pr is not None:
        text += f" peft+gc's own step is {pr:.2f}x its matmul floor."
    return text


def _kept_note(shape: str, kept_tps: float, r: Row, kept: Row | None) -> str:
    text = (
        f"- {shape}, mesp keeping tapes / peft+gc tokens/s: {kept_tps:.2f} against ≥ "
        f"{PEFT_KEPT_GOAL:g}, short by {1 - kept_tps / PEFT_KEPT_GOAL:.0%}. Keeping every tape "
        "skips the recompute, 2·N·T of the 6·N·T floor: at most 1.5x the recomputing step's "
        "speed if GEMMs were all of it"
    )
    speedup = ratio(secs(r), secs(kept))
    if speedup is not None:
        text += f"; measured {speedup:.2f}x over mesp recomputing every block"
    fl = floor_s(kept)
    if fl is not None:
        text += f", its step {secs(kept) / (fl * 2 / 3):.2f}x its own 4·N·T floor"  # type: ignore[operator]
    return text + "."


def _bounds(shape: str, r: Row, fp: Row | None, peft: Row | None) -> list[str]:
    """What bounds the PEFT comparisons, from the same rows."""
    if not (ok(r) and ok(peft)):
        return []
    w, tot, pt = mem(r, "weights"), mem(r, "total"), mem(peft, "total")
    base = peft["config"]["dtype"]  # type: ignore[index]
    out = [
        f"- {shape}, total vs peft+gc: the frozen weights bound it. mesp holds {w:.0f} of its "
        f"{tot:.0f} MiB in 4-bit weights (working {mem(r):.0f} MiB against peft+gc's "
        f"{mem(peft):.0f}); at {base}, weights alone are {mem(fp, 'weights') or 0:.0f} of "
        f"peft+gc's {pt:.0f} MiB, so no engine gets under {(mem(fp, 'weights') or 0) / pt:.2f} "
        "without taking the weights out of memory, which `--stream-weights` does (row above)."
    ]
    if secs(r) and secs(peft) and secs(fp):
        out.append(
            f"- {shape}, speed vs peft+gc: mesp on the 4-bit base dequantizes every weight three "
            f"times a step (forward, recompute, backward), where peft+gc multiplies by its {base} "
            f"weights directly; on the same {base} base mesp runs at "
            f"{secs(peft) / secs(fp):.2f}x peft+gc's tokens/s in table 1's time children "
            "(separate processes, minutes apart; the side-by-side ratio is the targets row)."  # type: ignore[operator]
        )
    return out


__all__ = ["cpu_dtype", "headline_dtype", "targets"]
