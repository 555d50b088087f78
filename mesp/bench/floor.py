"""The matmul floor of a training step: 6·N·T floating-point operations at the GEMM rate that
the same child process measured just before its timed steps.

N is the count of base weights that take part in matmuls: every block's seven projections
(q, k, v, o, gate, up, down) and the LM head (vocab × hidden, tied or not: the head is a matmul
either way; the embedding lookup is not). T is the tokens of one step (batch × seq). With a
frozen base a step multiplies by every weight three times, 2·N·T flops each: the forward, the
recompute of the block (mesp, mebp and peft+gc all recompute) and the input gradient (no weight
gradient for a frozen base). LoRA's rank-r products, attention's score and value products and
every elementwise op are left out, so no step can run below the floor at that GEMM rate; a row
that keeps every tape (mesp-budget) skips the recompute, so its own lower bound is 4·N·T, two
thirds of the column.

The probe times the block's projection shapes at T tokens (forward x·Wᵀ and input gradient
dy·W, into preallocated outputs), best of a few passes, in the dtype the GEMMs really run in:
fp32 for fp32 rows and for bf16 rows on a CPU without a bf16 GEMM (mesp.ops.matmul computes
those in fp32), the row's own dtype where the kernel is native. The time child probes right
before every timed step (GemmProbe, operands made once), since on a shared machine the rate
moves by tens of percent between one step and the next: each step is set against its own probe.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mesp.ops import matmul as matmul_ops

FLOPS_PER_PARAM_TOKEN = 6  # forward + recompute + input gradient, 2 flops per multiply-add each


def _projections(cfg: Any) -> list[tuple[int, int]]:
    """(out, in) of one block's seven projections."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, i = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def matmul_params(cfg: Any) -> int:
    """N: the base weights every token multiplies by (all blocks' projections + the LM head)."""
    block = sum(o * i for o, i in _projections(cfg))
    return cfg.num_hidden_layers * block + cfg.vocab_size * cfg.hidden_size


def floor_flops(cfg: Any, tokens: int) -> int:
    """6·N·T."""
    return FLOPS_PER_PARAM_TOKEN * matmul_params(cfg) * tokens


def probe_dtype(dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The dtype the step's GEMMs run in (mesp.ops.matmul's own decision)."""
    if matmul_ops.computes_in_fp32(torch.empty(0, dtype=dtype, device=device)):
        return torch.float32
    return dtype


class GemmProbe:
    """One block's projection GEMMs at `tokens` rows, operands made once, so that the time
    child can probe the rate right before every timed step (this shared machine's GEMM rate
    drifts by tens of percent between one step and the next)."""

    def __init__(self, cfg: Any, tokens: int, dtype: torch.dtype) -> None:
        self.run = probe_dtype(dtype)
        g = torch.Generator().manual_seed(0)
        self.cases = []
        for o, i in _projections(cfg):
            w = torch.randn(o, i, generator=g).to(self.run)
            x, dy = torch.randn(tokens, i, generator=g).to(self.run), torch.randn(tokens, o)
            y, dx = torch.empty(tokens, o, dtype=self.run), torch.empty(tokens, i, dtype=self.run)
            self.cases.append((w, x, dy.to(self.run), y, dx))
        self.flops = sum(2 * 2 * tokens * w.numel() for w, *_ in self.cases)
        self._pass()  # one untimed pass: first-touch and kernel selection

    def _pass(self) -> float:
        t = time.perf_counter()
        for w, x, dy, y, dx in self.cases:
            torch.mm(x, w.t(), out=y)
            torch.mm(dy, w, out=dx)
        return time.perf_counter() - t

    def rate(self, passes: int = 5) -> dict[str, Any]:
        """GFLOP/s of the best of `passes` passes (x·Wᵀ and dy·W for all seven projections)."""
        times = [self._pass() for _ in range(max(1, passes))]
        return {
            "gflops": self.flops / min(times) / 1e9,
            "dtype": str(self.run).removeprefix("torch."),
            "pass_flops": self.flops,
            "passes_s": times,
            "threads": torch.get_num_threads(),
        }


def gemm_rate(cfg: Any, tokens: int, dtype: torch.dtype, passes: int = 5) -> dict[str, Any]:
    """GFLOP/s of one block's projection GEMMs at `tokens` rows, best of `passes` (one
    untimed pass first). Each pass: x·Wᵀ and dy·W for all seven projections."""
    return GemmProbe(cfg, tokens, dtype).rate(passes)


def matmul_floor(cfg: Any, tokens: int, gflops: float) -> dict[str, Any]:
    """What the report puts beside a step time: N, T, 6·N·T and its seconds at `gflops`."""
    flops = floor_flops(cfg, tokens)
    return {"params": matmul_params(cfg), "tokens": tokens, "flops": flops,
            "seconds": flops / (gflops * 1e9)}  # fmt: skip


__all__ = ["GemmProbe", "floor_flops", "gemm_rate", "matmul_floor", "matmul_params", "probe_dtype"]
