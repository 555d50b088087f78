"""`mesp bench dequant`'s layer-step rows: one Qwen2.5-0.5B layer's seven frozen projections,
forward and backward (y = x Wᵀ, then dx = dy W) through the product's `frozen_matmul`, on a
4-bit base against the same weights dense in fp32.

That is the base matmul work a training step repeats per layer, with dequantization on every
use as the engines pay it. The bases are timed in rounds, one pass of the whole layer on each
base per round in a rotating order, so drift on a shared machine falls on all alike; the ratio
is the median of the per-round ratios, with their range beside it.
Target (issue 17): the 4-bit fp32 layer-step ≤ 1.06x dense fp32 at 256 tokens.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from mesp.models.linear import FrozenWeight, frozen_matmul
from mesp.ops import native
from mesp.quant import QuantSpec

LAYER = ((896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864))
GOAL = 1.06


def _pass(x: torch.Tensor, fw: FrozenWeight, dy: torch.Tensor) -> float:
    t = time.perf_counter()
    y = frozen_matmul(x, fw)
    torch.autograd.grad(y, x, dy)  # dx = dy W (returned, not accumulated into x.grad)
    return time.perf_counter() - t


def measure_layer_step(
    dtype: str, tokens: int, steps: int, warmup: int, group: int = 64
) -> dict[str, Any]:
    """`steps` rounds after `warmup`: each round times one pass of the whole layer on every
    base (dense fp32, dense in `dtype`, 4-bit in `dtype`), the bases in a rotating order, so
    drift on a shared machine falls on all of them alike. A base's ms: the median of its
    round totals; the ratio: the median over rounds of 4-bit / dense fp32 in that round."""
    dt, g = getattr(torch, dtype), torch.Generator().manual_seed(0)
    spec = QuantSpec(4, group)
    names = ["dense_fp32_ms", "quant_ms"] + (["dense_ms"] if dt != torch.float32 else [])
    layer: dict[str, list[tuple[FrozenWeight, torch.Tensor, torch.Tensor]]] = {k: [] for k in names}
    for o, i in LAYER:
        w = torch.randn(o, i, generator=g) * 0.02
        x32, dy32 = torch.randn(tokens, i, generator=g), torch.randn(tokens, o, generator=g)
        for k in names:
            kdt = torch.float32 if k == "dense_fp32_ms" else dt
            fw = FrozenWeight(o, i, kdt)
            fw.set_dense(w.to(kdt), spec if k == "quant_ms" else None)
            layer[k].append((fw, x32.to(kdt).requires_grad_(), dy32.to(kdt)))
    totals: dict[str, list[float]] = {k: [] for k in names}
    for n in range(warmup + steps):
        for k in names[n % len(names) :] + names[: n % len(names)]:
            t = sum(_pass(x, fw, dy) for fw, x, dy in layer[k])
            if n >= warmup:
                totals[k].append(t)
    ratios = [q / d for q, d in zip(totals["quant_ms"], totals["dense_fp32_ms"], strict=True)]
    ms = {k: statistics.median(v) * 1e3 for k, v in totals.items()}
    if dt == torch.float32:
        ms["dense_ms"] = ms["dense_fp32_ms"]
    spread = [min(ratios), max(ratios)]
    return {"table": "dequant", "part": "layer", "status": "ok", "dtype": dtype, "tokens": tokens,
            "bits": 4, "group_size": group, "threads": torch.get_num_threads(),
            "native": native.library() is not None, **ms, "rounds": steps,
            "ratio": statistics.median(ratios), "ratio_range": spread}  # fmt: skip


def line(r: dict[str, Any]) -> str:
    return (
        f"layer-step {r['dtype']:>8} tokens {r['tokens']:>4}: 4-bit {r['quant_ms']:.2f} ms, "
        f"dense {r['dense_ms']:.2f} ms, dense fp32 {r['dense_fp32_ms']:.2f} ms, "
        f"4-bit / dense fp32 {r['ratio']:.3f}{_spread(r)}"
    )


def _spread(r: dict[str, Any]) -> str:
    """' (rounds lo–hi over n rounds)' for rows timed in rounds (older rows have no range)."""
    if "ratio_range" not in r:
        return ""
    lo, hi = r["ratio_range"]
    return f" (rounds {lo:.3f}–{hi:.3f} over {r['rounds']})"


def section(rows: list[dict[str, Any]]) -> list[str]:
    ok = [r for r in rows if r.get("part") == "layer" and r.get("status") == "ok"]
    if not ok:
        return []
    r0 = ok[0]
    lines = [
        "### Layer-step: dequantize on every use, forward and backward",
        "",
        f"One Qwen2.5-0.5B layer's seven projections through `frozen_matmul` (y = x Wᵀ, then "
        f"dx = dy W), {r0['bits']}-bit group {r0['group_size']}, {r0['threads']} thread(s), "
        f"the bases timed in rotating rounds (ratio: median of the per-round ratios); native "
        f"dequantizer "
        f"{'on' if r0['native'] else 'off (no compiler: the pure-torch path)'}.",
        "",
        "| dtype | tokens | 4-bit ms | dense ms | dense fp32 ms | 4-bit / dense | "
        "4-bit / dense fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(ok, key=lambda r: (r["dtype"] != "float32", r["tokens"])):
        lines.append(
            f"| {r['dtype']} | {r['tokens']} | {r['quant_ms']:.2f} | {r['dense_ms']:.2f} | "
            f"{r['dense_fp32_ms']:.2f} | {r['quant_ms'] / r['dense_ms']:.3f} | "
            f"{r['ratio']:.3f}{_spread(r)} |"
        )
    head = [r for r in ok if r["dtype"] == "float32" and r["tokens"] == 256]
    if head:
        v = head[0]["ratio"]
        verdict = "met" if v <= GOAL else f"MISSED by {v / GOAL - 1:.0%}"
        lines += ["", f"- Target fp32 4-bit layer-step at 256 tokens ≤ {GOAL}x dense: "
                  f"{v:.3f}x{_spread(head[0])}, {verdict}."]  # fmt: skip
    return [*lines, ""]


__all__ = ["GOAL", "line", "measure_layer_step", "section"]
