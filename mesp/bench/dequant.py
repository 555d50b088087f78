"""`mesp bench dequant`: on-the-fly dequantization timed against the matmul it feeds.

A quantized linear dequantizes its weight, multiplies, and drops the weight. That is only
worth it if dequantizing costs little next to the matmul: this table measures both, at
Qwen2.5-0.5B's projection shapes, for one token (decode) and a training row (256 tokens), in
float32 and bfloat16. Times are medians of `--steps` runs after `--warmup` untimed ones, in
this process, one row per (dtype, shape, tokens); ratio = dequantize / matmul. The matmul is
the product's (`mesp.ops.matmul.linear`: fp32 compute for bf16 where the CPU has no bf16 GEMM).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mesp.bench import layer_step
from mesp.bench.output import write_row
from mesp.ops.matmul import linear
from mesp.quant import QuantSpec, dequantize, quantize

# (out_features, in_features): q/o proj, k/v proj, gate/up proj, down proj.
QWEN05_SHAPES = ((896, 896), (128, 896), (4864, 896), (896, 4864))
TOKENS = (1, 256)


@dataclass
class DequantConfig:
    dtype: str
    out_features: int
    in_features: int
    tokens: int
    bits: int = 4
    group_size: int = 64
    threads: int = 0


def median_ms(fn: Callable[[], object], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.no_grad()
def measure(c: DequantConfig, steps: int, warmup: int) -> dict[str, Any]:
    dtype = getattr(torch, c.dtype)
    spec = QuantSpec(c.bits, c.group_size)
    g = torch.Generator().manual_seed(0)
    packed = quantize(torch.randn(c.out_features, c.in_features, generator=g) * 0.02, spec)
    wq, scales, biases = packed[0], packed[1].to(dtype), packed[2].to(dtype)
    w = dequantize(wq, scales, biases, spec)
    x = torch.randn(c.tokens, c.in_features, generator=g).to(dtype)
    deq = median_ms(lambda: dequantize(wq, scales, biases, spec), steps, warmup)
    mm = median_ms(lambda: linear(x, w), steps, warmup)  # the product's kernel (ops/matmul)
    return {"table": "dequant", "status": "ok", "config": asdict(c), "dequant_ms": deq,
            "matmul_ms": mm, "ratio": deq / mm}  # fmt: skip


def run_dequant(
    out: Path, steps: int, warmup: int, threads: int | None, command: str
) -> list[dict[str, Any]]:
    if threads:
        torch.set_num_threads(threads)
    rows = []
    for dtype in ("float32", "bfloat16"):
        for tokens in TOKENS:
            for o, i in QWEN05_SHAPES:
                c = DequantConfig(dtype, o, i, tokens, threads=torch.get_num_threads())
                row = {**measure(c, steps, warmup), "command": command}
                path = out / "rows" / "dequant" / f"{dtype}_{o}x{i}_t{tokens}.json"
                rows.append(write_row(path, row, indent=1))
    for dtype in ("float32", "bfloat16"):  # the layer-step: forward and backward, per layer
        row = {**layer_step.measure_layer_step(dtype, 256, steps, warmup), "command": command}
        rows.append(write_row(out / "rows" / "dequant" / f"layer_{dtype}_t256.json", row, indent=1))
    return rows


def line(r: dict[str, Any]) -> str:
    if r.get("part") == "layer":
        return layer_step.line(r)
    c = r["config"]
    return (
        f"{c['dtype']:>8} {c['out_features']:>5}x{c['in_features']:<5} tokens {c['tokens']:>4}: "
        f"dequantize {r['dequant_ms']:.3f} ms, matmul {r['matmul_ms']:.3f} ms, "
        f"ratio {r['ratio']:.2f}"
    )


def section(rows: list[dict[str, Any]]) -> list[str]:
    every = [r for r in rows if r.get("table") == "dequant" and r.get("status") == "ok"]
    ok = [r for r in every if r.get("part") != "layer"]
    if not ok:
        return layer_step.section(every)
    c0 = ok[0]["config"]
    lines = [
        "## Dequantization against the matmul it feeds",
        "",
        f"`{ok[0]['command']}` — {c0['bits']}-bit, group {c0['group_size']}, "
        f"{c0['threads']} thread(s), Qwen2.5-0.5B projection shapes. A quantized linear pays the "
        "dequantize column on every use (forward, and mesp's backward recompute).",
        "",
        "| dtype | out x in | tokens | dequantize ms | matmul ms | dequantize / matmul |",
        "|---|---|---|---|---|---|",
    ]
    key = lambda r: (r["config"]["dtype"], r["config"]["tokens"], r["config"]["in_features"])  # noqa: E731
    for r in sorted(ok, key=key):
        c = r["config"]
        lines.append(
            f"| {c['dtype']} | {c['out_features']}x{c['in_features']} | {c['tokens']} | "
            f"{r['dequant_ms']:.3f} | {r['matmul_ms']:.3f} | {r['ratio']:.2f} |"
        )
    notes = []
    for tokens in sorted({r["config"]["tokens"] for r in ok}):
        ratios = [r["ratio"] for r in ok if r["config"]["tokens"] == tokens]
        notes.append(
            f"- {tokens} token(s): dequantize / matmul from {min(ratios):.2f} to {max(ratios):.2f}."
        )
    notes.append(
        "- A ratio above 1 means the matmul (which reads the weight once) is cheaper than "
        "rebuilding the dense weight: per-token generation would want a fused low-bit matmul; "
        "training rows of a few hundred tokens amortize the dequantization."
    )
    return [*lines, "", *notes, "", *layer_step.section(every)]


__all__ = ["DequantConfig", "line", "measure", "median_ms", "run_dequant", "section"]
