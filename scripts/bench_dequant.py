"""Time on-the-fly dequantization against the matmul it feeds, for Qwen2.5-0.5B shapes.

Usage: python scripts/bench_dequant.py [--bits 4] [--group-size 64] [--tokens 256] [--runs 15]
       [--threads N]. Times are medians; the CPU should be otherwise idle.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mesp.quant import QuantSpec, dequantize, quantize

# (out_features, in_features): q/o proj, k/v proj, gate/up proj, down proj.
QWEN05_SHAPES = [(896, 896), (128, 896), (4864, 896), (896, 4864)]


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_dequant(
    out: int = 896,
    inp: int = 4864,
    tokens: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    spec: QuantSpec | None = None,
    runs: int = 15,
) -> tuple[float, float]:
    """Median milliseconds of (dequantize, ``x @ W.T`` with x of shape (tokens, inp))."""
    spec = spec or QuantSpec()
    torch.manual_seed(0)
    qs = quantize(torch.randn(out, inp, dtype=dtype) * 0.02, spec)
    w = dequantize(*qs, spec)
    x = torch.randn(tokens, inp, dtype=dtype)
    with torch.no_grad():
        t_deq = _median_ms(lambda: dequantize(*qs, spec), runs)
        t_mm = _median_ms(lambda: x @ w.T, runs)
    return t_deq, t_mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = QuantSpec(args.bits, args.group_size)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {spec}")
    print(f"{'dtype':>8} {'out x in':>11} {'dequant ms':>11} {'matmul ms':>10} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for out, inp in QWEN05_SHAPES:
            t_deq, t_mm = bench_dequant(out, inp, args.tokens, dtype, spec, args.runs)
            name = str(dtype).removeprefix("torch.")
            ratio = t_deq / t_mm
            print(f"{name:>8} {out:>5}x{inp:<5} {t_deq:>11.3f} {t_mm:>10.3f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
