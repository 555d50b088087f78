"""Per-example gradient clipping (DP-SGD), where each LoRA gradient is made.

The unit of privacy is one row of the batch (one sequence). Every engine's backward hands each
LoRA linear's per-example gradients here instead of summing them over the batch: mesp's hand
backward calls `backward` (ops/lora_linear.py's lora_example_backward), and bp / mebp run the
linear through `_ExampleLoRA`, an autograd function whose backward is the same call. Example e's
gradient of one linear is (gA_e (r, in), gB_e (out, r)): rank × (in + out) numbers, so a
block's worth of them costs little beside its activations.

Clipping, with C the bound and K the adapted linears:
  per-layer  each linear's (gA_e, gB_e) is scaled to norm ≤ C/√K (an equal split: Σ (C/√K)² =
             C², so every example's whole gradient has norm ≤ C). A linear's gradients are
             complete once its block's backward ends: the engines call `block_done` there and
             only one block's per-example gradients are ever held.
  flat       one norm over the whole adapter per example, scaled to ≤ C. The norms are known
             only after the last block: the per-example gradients of every linear are held
             to the end of the step (batch × adapter numbers), then scaled and summed. Exact,
             one backward; memory grows by batch × adapter size.
The scale is min(1, bound / ‖g_e‖) (an example with a zero gradient keeps it). `finish` adds
Σ_e scale_e · g_e to each parameter's .grad; the noise and the division by the expected batch
size are the training loop's (mesp/training/privacy.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from mesp.models.linear import Linear
from mesp.models.transformer import CausalLM
from mesp.ops.lora_linear import lora_example_backward, lora_linear

CLIPPINGS = ("per-layer", "flat")


class ExampleClipper:
    """Clips and sums the per-example LoRA gradients of one batch of `rows` examples, each
    `seq` tokens (the batch's padded width), into the LoRA parameters' .grad."""

    def __init__(self, model: CausalLM, clip: float, clipping: str, rows: int, seq: int) -> None:
        if clipping not in CLIPPINGS:
            raise ValueError(f"clipping must be one of {CLIPPINGS}, got {clipping!r}")
        self.mods = list(model.lora_modules().values())
        self.clip, self.flat, self.rows, self.seq = clip, clipping == "flat", rows, seq
        self.layer_bound = clip / math.sqrt(len(self.mods))
        self._held: dict[int, tuple[Linear, Tensor, Tensor]] = {}  # id(mod) -> (mod, gA, gB)

    def backward(
        self,
        mod: Linear,
        dy: Tensor,
        x: Tensor,
        need_dx: bool = True,
        h: Tensor | None = None,
        start: int = 0,
    ) -> Tensor | None:
        """dx of one LoRA linear; its per-example gradients are held until clipped."""
        assert mod.lora_A is not None and mod.lora_B is not None
        A, B, s = mod.lora_A, mod.lora_B, mod.lora_scale
        dx, ids, gA, gB = lora_example_backward(dy, x, mod, A, B, s, self.seq, start, need_dx, h)
        held = self._held.get(id(mod))
        if held is None:
            shape = (self.rows,)
            zA = torch.zeros(*shape, *A.shape, dtype=torch.float32, device=gA.device)
            held = (mod, zA, torch.zeros(*shape, *B.shape, dtype=torch.float32, device=gB.device))
            self._held[id(mod)] = held
        held[1].index_add_(0, ids.to(gA.device), gA)
        held[2].index_add_(0, ids.to(gB.device), gB)
        return dx

    def block_done(self) -> None:
        """Per-layer: the linears seen so far are complete; clip and add them now."""
        if not self.flat:
            self._flush()

    def finish(self) -> Tensor:
        """Clip and add what is still held; returns each example's scale of its last clip (flat:
        the one scale; per-layer: of the last linear), for logs and tests."""
        return self._flush()

    def _flush(self) -> Tensor:
        held = list(self._held.values())
        self._held.clear()
        scale = torch.ones(self.rows)
        if not held:
            return scale
        if self.flat:
            sq = sum(_sq_norms(gA, gB) for _, gA, gB in held)
            scale = _scale(sq, self.clip)  # type: ignore[arg-type]
        for mod, gA, gB in held:
            if not self.flat:
                scale = _scale(_sq_norms(gA, gB), self.layer_bound)
            _add_grad(mod.lora_A, gA, scale)
            _add_grad(mod.lora_B, gB, scale)
        return scale.cpu()

    def attach(self) -> None:
        """Route every adapted linear through this clipper (autograd's backward, and the
        hand backward's `mod.per_example` check)."""
        for m in self.mods:
            m.per_example = self

    def detach(self) -> None:
        for m in self.mods:
            m.per_example = None

    def forward(self, mod: Linear, x: Tensor) -> Tensor:
        """The linear under autograd with the per-example backward (bp, mebp)."""
        return _ExampleLoRA.apply(x, mod.lora_A, mod.lora_B, mod, self)  # type: ignore[no-any-return]


def _sq_norms(gA: Tensor, gB: Tensor) -> Tensor:
    """(rows,) fp64 squared norms of each example's (gA_e, gB_e)."""
    return gA.flatten(1).double().square().sum(1) + gB.flatten(1).double().square().sum(1)


def _scale(sq: Tensor, bound: float) -> Tensor:
    """(rows,) min(1, bound / ‖g_e‖), 1 where ‖g_e‖ = 0."""
    norm = sq.sqrt()
    return torch.where(norm > bound, bound / norm.clamp_min(1e-300), 1.0).float()


def _add_grad(p: torch.nn.Parameter | None, g: Tensor, scale: Tensor) -> None:
    """p.grad += Σ_e scale_e · g_e (in p's dtype)."""
    assert p is not None
    summed = torch.einsum("e,e...->...", scale.to(g.device), g).to(p.dtype)
    if p.grad is None:
        p.grad = summed
    else:
        p.grad += summed


class _ExampleLoRA(torch.autograd.Function):
    """y = x Wᵀ + b + s·(x Aᵀ) Bᵀ, the module's own forward; backward returns dx and hands A's
    and B's per-example gradients to the clipper (autograd sets no .grad on them)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, A: Tensor, B: Tensor, mod: Linear, clip: Any) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.mod, ctx.clip = mod, clip
        return lora_linear(x, mod, mod.bias, A, B, mod.lora_scale)

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        dx = ctx.clip.backward(ctx.mod, dy, x, need_dx=ctx.needs_input_grad[0])
        return dx, None, None, None, None
