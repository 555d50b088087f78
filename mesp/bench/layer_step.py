"""`mesp bench dequant`'s layer-step rows: one Qwen2.5-0.5B layer's seven frozen projections,
forward and backward (y = x Wᵀ, then dx = dy W) through the product's `frozen_matmul`, on a
4-bit base against the same weights dense in fp32.

That is the base matmul work a training step repeats per layer, with dequantization on every
use as the engines pay it. The two bases are timed interleaved, one pass of each in turn, so
drift on a shared machine falls on both alike; ms are medians per projection, summed.
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
    y.backward(dy)
    return time.perf_counter() - t


def measure_layer_step(
    dtype: str, tokens: int, steps: int, warmup: int, group: int = 64
) -> dict[str, Any]:
    """Summed per-projection medians: dense fp32, dense in `dtype`, 4-bit in `dtype`."""
    dt, g = getattr(torch, dtype), torch.Generator().manual_seed(0)
    spec = QuantSpec(4, group)
    sums = {"dense_fp32_ms": 0.0, "dense_ms": 0.0, "quant_ms": 0.0}
    for o, i in LAYER:
        w = torch.randn(o, i, generator=g) * 0.02
        bases = {"dense_fp32_ms": (w, torch.float32)}
        if dt != torch.float32:
            bases["dense_ms"] = (w.to(dt), dt)
        fws = {}
        for k, (wk, kdt) in bases.items():
            fws[k] = FrozenWeight(o, i, kdt)
            fws[k].set_dense(wk)
        fws["quant_ms"] = FrozenWeight(o, i, dt)
        fws["quant_ms"].set_dense(w.to(dt), spec)
        x32, dy32 = torch.randn(tokens, i, generator=g), torch.randn(tokens, o, generator=g)
        times: dict[str, list[float]] = {k: [] for k in fws}
        for n in range(warmup + steps):
            for k, fw in fws.items():
                kdt = fw.dtype
                x = x32.to(kdt).requires_grad_()
                t = _pass(x, fw, dy32.to(kdt))
                if n >= warmup:
                    times[k].append(t)
        for k in times:
            sums[k] += statistics.median(times[k]) * 1e3
    if dt == torch.float32:
        sums["dense_ms"] = sums["dense_fp32_ms"]
    return {"table": "dequant", "part": "layer", "status": "ok", "dtype": dtype, "tokens": tokens,
            "bits": 4, "group_size": group, "threads": torch.get_num_threads(),
            "native": native.library() is not None, **sums,
            "ratio": sums["quant_ms"] / sums["dense_fp32_ms"]}  # fmt: skip


def line(r: dict[str, Any]) -> str:
    return (
        f"layer-step {r['dtype']:>8} tokens {r['tokens']:>4}: 4-bit {r['quant_ms']:.2f} ms, "
        f"dense {r['dense_ms']:.2f} ms, dense fp32 {r['dense_fp32_ms']:.2f} ms, "
        f"4-bit / dense fp32 {r['ratio']:.3f}"
    )


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
        f"the bases timed interleaved; native dequantizer "
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
            f"{r['ratio']:.3f} |"
        )
    head = [r for r in ok if r["dtype"] == "float32" and r["tokens"] == 256]
    if head:
        v = head[0]["ratio"]
        verdict = "met" if v <= GOAL else f"MISSED by {v / GOAL - 1:.0%}"
        lines += ["", f"- Target fp32 4-bit layer-step at 256 tokens ≤ {GOAL}x dense: "
                  f"{v:.3f}x, {verdict}."]  # fmt: skip
    return [*lines, ""]


__all__ = ["GOAL", "line", "measure_layer_step", "section"]
