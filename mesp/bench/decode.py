"""`mesp bench decode`: 4-bit decoding through the int4 kernel against dequantize + matmul.

Two tables, both measured in this process, the kernels side by side (medians of `--steps`
runs after `--warmup`):
- layer: one Qwen2.5-0.5B layer's seven projections (q, k, v, o, gate, up, down) at a few row
  counts, summed: dense fp32 matmul (the reference), dequantize + matmul (the training path,
  `FrozenWeight.linear`: blocks dequantized natively where the kernel is built),
  and the int4 kernel on its packed copy (mesp/ops/int4_mm.py). Target: 1 row ≤ 0.5x dense.
- generate: `mesp generate`'s loop (mesp.inference.generate) on a real 4-bit model, greedy,
  `--decode-tokens` new tokens after a short prompt, tokens/s with `int4` on and off, each
  timed twice alternating (best of two). Target: int4 ≥ 2x the dequantizing path.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from mesp.bench.dequant import median_ms
from mesp.bench.output import write_row
from mesp.models.linear import FrozenWeight
from mesp.ops import int4_mm
from mesp.ops.matmul import linear
from mesp.quant import QuantSpec, dequantize

# (out, in) of one Qwen2.5-0.5B layer: q, k, v, o, gate, up, down.
LAYER = ((896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864))
ROWS = (1, 4, 16, 64, 256)
PROMPT = "The quality of mercy is not strained; it droppeth as the gentle rain"


@torch.no_grad()
def measure_layer(rows: int, steps: int, warmup: int, group: int = 64) -> dict[str, Any]:
    """Summed medians over the layer's projections at `rows` rows of fp32 activations."""
    spec, g = QuantSpec(4, group), torch.Generator().manual_seed(0)
    dense = deq = int4 = 0.0
    for o, i in LAYER:
        fw = FrozenWeight(o, i, torch.float32)  # the product's quantized linear (no int4 copy)
        fw.set_dense(torch.randn(o, i, generator=g) * 0.02, spec)
        wq, s, b = fw.weight, fw.scales, fw.biases
        w, x = dequantize(wq, s, b, spec), torch.randn(rows, i, generator=g)
        p = int4_mm.pack(wq, s, b, spec)
        dense += median_ms(lambda: linear(x, w), steps, warmup)  # noqa: B023
        deq += median_ms(lambda: fw.linear(x), steps, warmup)  # noqa: B023
        int4 += median_ms(lambda: int4_mm.int4_linear(x, p), steps, warmup)  # noqa: B023
    return {"table": "decode", "part": "layer", "status": "ok", "rows": rows, "group": group,
            "threads": torch.get_num_threads(), "dense_ms": dense, "dequant_ms": deq,
            "int4_ms": int4}  # fmt: skip


@torch.no_grad()
def measure_generate(model: str, tokens: int) -> dict[str, Any]:
    """tokens/s of the product's generate loop on `model`, int4 kernel on and off."""
    from mesp.inference.generate import generate
    from mesp.loading.session import ModelOptions, open_model

    loaded = open_model(ModelOptions(model=model))
    tok = loaded.require_tokenizer()
    ids = tok.encode(PROMPT)
    generate(loaded.model, ids, 2)  # warm-up: first-call allocations
    best = {True: float("inf"), False: float("inf")}
    outs: dict[bool, list[int]] = {}
    for _ in range(2):
        for on in (False, True):
            t0 = time.perf_counter()
            outs[on] = generate(loaded.model, ids, tokens, int4=on)  # no stop ids: all tokens
            best[on] = min(best[on], time.perf_counter() - t0)
    n = {on: len(o) for on, o in outs.items()}
    same = next(
        (i for i, (a, b) in enumerate(zip(outs[True], outs[False], strict=False)) if a != b),
        min(n.values()),
    )
    return {"table": "decode", "part": "generate", "status": "ok", "model": model,
            "prompt_tokens": len(ids), "tokens": n[True], "threads": torch.get_num_threads(),
            "int4_tok_s": n[True] / best[True], "dequant_tok_s": n[False] / best[False],
            "same_prefix": same}  # fmt: skip


def run_decode(
    out: Path, models: tuple[str, ...], tokens: int, steps: int, warmup: int, command: str
) -> list[dict[str, Any]]:
    rows = []
    for r in ROWS:
        row = {**measure_layer(r, steps, warmup), "command": command}
        rows.append(write_row(out / "rows" / "decode" / f"layer_r{r}.json", row, indent=1))
    for m in models:
        row = {**measure_generate(m, tokens), "command": command}
        name = m.replace("/", "_").replace(":", "_")
        rows.append(write_row(out / "rows" / "decode" / f"generate_{name}.json", row, indent=1))
    return rows


def line(r: dict[str, Any]) -> str:
    if r["part"] == "layer":
        return (
            f"layer rows {r['rows']:>3}: dense {r['dense_ms']:.3f} ms, dequantize+matmul "
            f"{r['dequant_ms'] / r['dense_ms']:.2f}x, int4 {r['int4_ms'] / r['dense_ms']:.2f}x"
        )
    return (
        f"generate {r['model']}: int4 {r['int4_tok_s']:.1f} tok/s, dequantize "
        f"{r['dequant_tok_s']:.1f} tok/s ({r['int4_tok_s'] / r['dequant_tok_s']:.2f}x)"
    )


def section(rows: list[dict[str, Any]]) -> list[str]:
    ok = [r for r in rows if r.get("table") == "decode" and r.get("status") == "ok"]
    layer = sorted((r for r in ok if r["part"] == "layer"), key=lambda r: r["rows"])
    gen = [r for r in ok if r["part"] == "generate"]
    if not ok:
        return []
    lines = ["## 4-bit decoding: the int4 kernel", "", f"`{ok[0]['command']}`", ""]
    if layer:
        lines += [
            f"One Qwen2.5-0.5B layer's seven projections, 4-bit group {layer[0]['group']}, "
            f"fp32 activations, {layer[0]['threads']} thread(s); ms summed over the projections, "
            "ratios against the dense fp32 matmul. `mesp generate` uses the kernel for rows "
            f"up to {int4_mm.DECODE_ROWS} and dequantizes above.",
            "",
            "| rows | dense fp32 ms | dequantize + matmul | int4 kernel |",
            "|---|---|---|---|",
        ]
        for r in layer:
            d = r["dense_ms"]
            lines.append(
                f"| {r['rows']} | {d:.3f} | {r['dequant_ms'] / d:.2f}x | {r['int4_ms'] / d:.2f}x |"
            )
        one = next((r for r in layer if r["rows"] == 1), None)
        if one:
            v = one["int4_ms"] / one["dense_ms"]
            verdict = "met" if v <= 0.5 else f"MISSED by {v / 0.5:.2f}x"
            lines += ["", f"- Target 1-row int4 ≤ 0.5x dense: {v:.2f}x, {verdict}."]
    if gen:
        lines += [
            "",
            "| model | new tokens | int4 tok/s | dequantize tok/s | speed-up | same tokens |",
            "|---|---|---|---|---|---|",
        ]
        notes = []
        for r in gen:
            x = r["int4_tok_s"] / r["dequant_tok_s"]
            lines.append(
                f"| {r['model']} | {r['tokens']} | {r['int4_tok_s']:.1f} | "
                f"{r['dequant_tok_s']:.1f} | {x:.2f}x | first {r['same_prefix']} |"
            )
            verdict = "met" if x >= 2 else f"MISSED by {2 / x:.2f}x"
            notes.append(
                f"- Target `mesp generate` int4 ≥ 2x on {r['model']}: {x:.2f}x, {verdict}."
            )
        lines += [
            "",
            *notes,
            "- Greedy tokens, prompt of "
            f"{gen[0]['prompt_tokens']} tokens; 'same tokens' counts the leading tokens both "
            "kernels chose alike (they may part where two logits tie within bf16 rounding: "
            "tests/test_int4_decode.py).",
        ]
    return [*lines, ""]


__all__ = ["line", "measure_generate", "measure_layer", "run_decode", "section"]
