"""Autograd Functions for LoRA training in an ordinary PyTorch graph, each beside its backward.

One LoRA linear; several LoRA projections of one input (q/k/v); the gated LoRA MLP; the linear +
cross-entropy loss head. Activations go through save_for_backward, so gradient checkpointing's
saved-tensor hooks see them; a frozen base rides along as a plain argument (a FrozenWeight or a
tensor), is never saved as a dense copy, and a packed one is dequantized again in backward.
Adapters (A, B) and biases are autograd inputs; the bases get no gradient and must not want one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.errors import MespError
from mesp.models.linear import FrozenWeight
from mesp.ops.cross_entropy import chunked_ce_loss, chunked_ce_loss_and_grad
from mesp.ops.lora_linear import (
    WeightSource,
    base_linear,
    base_matmul,
    lora_linear_backward,
)
from mesp.ops.matmul import linear
from mesp.ops.mlp import ACTIVATIONS, gated_act, gated_act_backward

Maybe = Tensor | None


@dataclass(frozen=True)
class Proj:
    """y = x Wᵀ + b + s·(x Aᵀ)Bᵀ. W (out, in) frozen; A (r, in), B (out, r) None when the
    projection has no adapter. The LoRA branch runs in A's dtype (PEFT keeps fp32 adapters on a
    bf16 base) and is added into the base output in its dtype."""

    base: WeightSource
    bias: Maybe = None
    A: Maybe = None
    B: Maybe = None
    scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.base, Tensor) and self.base.requires_grad:
            raise MespError("a base weight requires grad; mesp.nn trains adapters only: freeze it")
        if (self.A is None) != (self.B is None):
            raise MespError("a LoRA projection needs both A and B, or neither")


def _fwd(x: Tensor, base: WeightSource, bias: Maybe, A: Maybe, B: Maybe, s: float) -> Tensor:
    """x (..., in) -> y (..., out). h = x Aᵀ (..., r) is dropped: backward recomputes it."""
    y = base_linear(x, base, None if bias is None else bias.to(x.dtype))
    if A is not None and B is not None:
        y.add_(linear(linear(x.to(A.dtype), A), B), alpha=s)
    return y


def _bwd(
    dy: Tensor,
    x: Tensor,
    base: WeightSource,
    bias: Maybe,
    A: Maybe,
    B: Maybe,
    s: float,
    need: Sequence[bool],
) -> tuple[Maybe, Maybe, Maybe, Maybe]:
    """(dx, dbias, dA, dB), each None unless need[i]. dbias = Σ_tokens dy; the adapter part is
    lora_linear_backward's: dB = s·dyᵀh, dA = (s·dy B)ᵀ x, dx = dy W + s·dy B A.
    Shapes: dy (..., out), x (..., in)."""
    gb = None
    if need[1] and bias is not None:
        gb = dy.reshape(-1, dy.shape[-1]).sum(0).to(bias.dtype)
    if A is None or B is None:
        dx = base_matmul(dy.to(x.dtype), base) if need[0] else None
        return dx, gb, None, None
    gA, gB = torch.zeros_like(A), torch.zeros_like(B)
    dx = lora_linear_backward(dy, x, base, A, B, s, gA, gB, need_dx=need[0])
    return dx, gb, gA if need[2] else None, gB if need[3] else None


class _LoRALinear(torch.autograd.Function):
    """Saves x (and refs to b, A, B); h = x Aᵀ is recomputed, W re-read or re-dequantized."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, b: Maybe, A: Maybe, B: Maybe, base: WeightSource, s: float
    ) -> Tensor:
        ctx.base, ctx.s = base, s
        ctx.save_for_backward(x, b, A, B)
        return _fwd(x, base, b, A, B, s)

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        x, b, A, B = ctx.saved_tensors
        return *_bwd(dy, x, ctx.base, b, A, B, ctx.s, ctx.needs_input_grad[:4]), None, None


def lora_linear(x: Tensor, p: Proj) -> Tensor:
    """x (..., in) -> (..., out), saving only x for backward."""
    return _LoRALinear.apply(x, p.bias, p.A, p.B, p.base, p.scale)


class _SharedInput(torch.autograd.Function):
    """n projections of one x (q/k/v): x saved once, one dx = Σᵢ dyᵢ Wᵢ + sᵢ·dyᵢ Bᵢ Aᵢ."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, meta: tuple, *ts: Maybe):  # type: ignore[override]
        ctx.meta = meta  # ((base, scale), ...) per projection; ts = (b, A, B) per projection
        ctx.save_for_backward(x, *ts)
        return tuple(_fwd(x, base, *ts[3 * i : 3 * i + 3], s) for i, (base, s) in enumerate(meta))

    @staticmethod
    def backward(ctx: Any, *dys: Tensor):  # type: ignore[override]
        x, *ts = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx: Maybe = None
        grads: list[Maybe] = []
        for i, ((base, s), dy) in enumerate(zip(ctx.meta, dys, strict=True)):
            wants = (need[0], *need[2 + 3 * i : 5 + 3 * i])
            d, gb, gA, gB = _bwd(dy, x, base, *ts[3 * i : 3 * i + 3], s, wants)
            dx = d if dx is None or d is None else dx.add_(d)
            grads += [gb, gA, gB]
        return dx, None, *grads


def lora_shared_input(x: Tensor, projs: Sequence[Proj]) -> tuple[Tensor, ...]:
    """(x Wᵢᵀ + bᵢ + sᵢ·(x Aᵢᵀ)Bᵢᵀ for each projection), one saved x for all of them."""
    meta = tuple((p.base, p.scale) for p in projs)
    ts = [t for p in projs for t in (p.bias, p.A, p.B)]
    return _SharedInput.apply(x, meta, *ts)


class _GatedMLP(torch.autograd.Function):
    """y = down(act(gate(x)) · up(x)). Saves x, gate, up (N×F each): act(gate)·up is one cheap
    elementwise op away, so it is rebuilt; gate and up would cost two (N × D × F) matmuls to
    rebuild, +1/3 of the MLP's training FLOPs (frozen bases need only dx in backward). Measured
    (Qwen2.5-0.5B widths, 4 layers, seq 512, fp32 CPU): recompute=True, which keeps x alone,
    saved 76 MiB of 381 but took 37% longer per step, so keeping them is the default."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, meta: tuple, *ts: Maybe):  # type: ignore[override]
        bases, scales, act, recompute = meta
        ctx.meta = meta
        gate = _fwd(x, bases[0], *ts[0:3], scales[0])  # (..., F)
        up = _fwd(x, bases[1], *ts[3:6], scales[1])  # (..., F)
        y = _fwd(gated_act(gate, up, act), bases[2], *ts[6:9], scales[2])  # (..., D)
        ctx.save_for_backward(x, *ts) if recompute else ctx.save_for_backward(x, gate, up, *ts)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        bases, scales, act, recompute = ctx.meta
        need = ctx.needs_input_grad
        if recompute:
            x, *ts = ctx.saved_tensors
            gate = _fwd(x, bases[0], *ts[0:3], scales[0])
            up = _fwd(x, bases[1], *ts[3:6], scales[1])
        else:
            x, gate, up, *ts = ctx.saved_tensors
        # m = act(g)·u (N, F), y = down(m):  dm = dy W_d + s_d·dy B_d A_d, with down's adapter
        # gradients taken at m;  dg = dm·u·act'(g), du = dm·act(g) (N, F);
        # dx = dg W_g + du W_u + the two LoRA terms (N, D), each adapter's dA, dB at x.
        m = gated_act(gate, up, act)
        dm, *g_down = _bwd(dy, m, bases[2], *ts[6:9], scales[2], (True, *need[8:11]))
        del m
        assert dm is not None
        d_gate, d_up = gated_act_backward(dm, gate, up, act)  # (..., F) each
        del dm, gate, up
        dx, *g_gate = _bwd(d_gate, x, bases[0], *ts[0:3], scales[0], (need[0], *need[2:5]))
        del d_gate
        dxu, *g_up = _bwd(d_up, x, bases[1], *ts[3:6], scales[1], (need[0], *need[5:8]))
        if dx is not None and dxu is not None:
            dx.add_(dxu)
        return dx, None, *g_gate, *g_up, *g_down


def lora_gated_mlp(
    x: Tensor, gate: Proj, up: Proj, down: Proj, act: str, recompute: bool = False
) -> Tensor:
    """x (..., D) -> down(act(gate(x)) · up(x)) (..., D); act 'silu' (SwiGLU) or 'gelu_tanh'."""
    if act not in ACTIVATIONS:
        raise MespError(f"unknown gated activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    meta = (
        (gate.base, up.base, down.base),
        (gate.scale, up.scale, down.scale),
        act,
        recompute,
    )
    ts = [t for p in (gate, up, down) for t in (p.bias, p.A, p.B)]
    return _GatedMLP.apply(x, meta, *ts)


class _LinearCE(torch.autograd.Function):
    """Mean token cross-entropy of z = h Wᵀ. The loss pass already holds each row chunk's
    softmax p, so dh = (p − onehot) W / n is formed right there and kept (N×D) in place of h:
    one pass over the head instead of two, and never an (N × V) logits tensor."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: Tensor,
        targets: Tensor,
        mask: Tensor,
        head: FrozenWeight,
        softcap: float | None,
        normalizer: float | None,
        rows: int,
        vchunk: int | None,
        grad: bool,
    ) -> Tensor:
        if grad:
            loss, n, dh = chunked_ce_loss_and_grad(
                h, targets, mask, head, softcap, rows, vchunk, normalizer
            )
            ctx.save_for_backward(dh)
        else:
            loss, n = chunked_ce_loss(h, targets, mask, head, softcap, rows, vchunk)
        norm = float(n if normalizer is None else normalizer)
        return loss / norm if norm > 0 else loss  # no targets: loss 0, gradient 0

    @staticmethod
    def backward(ctx: Any, g: Tensor):  # type: ignore[override]
        (dh,) = ctx.saved_tensors
        return dh * g.to(dh.dtype), None, None, None, None, None, None, None, None


def _tensor_head(w: Tensor) -> FrozenWeight:
    """A FrozenWeight viewing w's storage. Its constructor's placeholder is (0, 0), not (V, D):
    even a meta-device placeholder of full size is a storage the exact tracker counts (meta
    tensors stand for real bytes there), which put a phantom V×D head into every peak."""
    with torch.device("meta"):
        fw = FrozenWeight(0, 0, w.dtype)
    fw.out_features, fw.in_features = w.shape
    fw.set_dense(w.detach())
    return fw


def linear_cross_entropy(
    h: Tensor,
    head: FrozenWeight | Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    softcap: float | None = None,
    num_items: float | Tensor | None = None,
    chunk_rows: int | None = None,
    vocab_chunk: int | None = None,
) -> Tensor:
    """Mean cross-entropy of logits h Wᵀ (capped to cap·tanh(z/cap) with softcap) against the
    labels ≠ ignore_index; with num_items, their sum / num_items (HF Trainer's normalizer under
    gradient accumulation). h (..., D), labels (...), head (V, D). shift=True is HF's causal
    shift: position t is scored against labels[t + 1]. Logits exist chunk_rows rows at a time
    (default: a 128 MiB fp32 block), or also vocab_chunk columns at a time."""
    if isinstance(head, Tensor):
        if head.requires_grad:
            raise MespError("the LM head requires grad; linear_cross_entropy gives dh only")
        head = _tensor_head(head)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if labels.shape != h.shape[:-1]:
        raise MespError(f"labels {tuple(labels.shape)} do not match h {tuple(h.shape)}")
    mask = labels != ignore_index
    targets = labels.masked_fill(~mask, 0)
    rows = chunk_rows or min(8192, max(16, (1 << 25) // head.out_features))
    norm = None if num_items is None else float(num_items)
    grad = torch.is_grad_enabled() and h.requires_grad  # ctx.needs_input_grad ignores no_grad
    return _LinearCE.apply(h, targets, mask, head, softcap, norm, rows, vocab_chunk, grad)
