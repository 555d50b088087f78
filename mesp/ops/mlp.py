"""Gated MLP activations: SwiGLU (Llama, Qwen) and tanh-GeGLU (Gemma3), forward and backward."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.quant import tracing

ACTIVATIONS = ("silu", "gelu_tanh")


def _act(gate: Tensor, act: str) -> Tensor:
    """act(gate), (..., F): silu or tanh-approximated gelu."""
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def _act_backward(d: Tensor, gate: Tensor, act: str) -> Tensor:
    """d · act'(gate), (..., F): ATen's fused backward of `_act` (what autograd runs for it)."""
    if act == "silu":
        return torch.ops.aten.silu_backward(d, gate)
    return torch.ops.aten.gelu_backward(d, gate, approximate="tanh")


def gated_act(gate: Tensor, up: Tensor, act: str) -> Tensor:
    """m = act(gate) · up; gate/up (..., F)."""
    return _act(gate, act) * up


def gated_act_backward(dm: Tensor, gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """d gate = dm · up · act'(gate), d up = dm · act(gate). Shapes (..., F), in gate's dtype.
    silu'(g) = σ(g)(1 + g(1 − σ(g))).
    gelu_tanh(g) = ½g(1 + tanh u), u = √(2/π)(g + 0.044715g³):
      gelu' = ½(1 + tanh u) + ½g(1 − tanh²u)·√(2/π)(1 + 3·0.044715g²).
    Eager, act' is ATen's fused kernel (silu_backward / gelu_backward: one pass, fp32 math for
    bf16) fed dm · up: the very ops autograd runs for act(gate) · up, so the gradients equal
    bp's bit for bit, in four passes over (…, F) where the formula written out takes nine.
    Under export (the on-device programs) it is written out: ExecuTorch has no kernel for the
    fused ops, and torch.export keeps them whole."""
    if tracing():
        return _written_out(dm, gate, up, act)
    # at most five (…, F) tensors at once: gate, up, dm, then dm·up and d_gate, then d_gate
    # and d_up (written in place over act(gate): a product commutes bit for bit)
    d_gate = _act_backward(dm * up, gate, act)
    return d_gate, _act(gate, act).mul_(dm)


def _written_out(dm: Tensor, gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """The docstring's formulas in elementwise ops, math in float32."""
    g = gate.to(torch.promote_types(gate.dtype, torch.float32))
    if act == "silu":
        s = torch.sigmoid(g)
        a = g * s
        da = s * (1 + g * (1 - s))
    else:
        c = math.sqrt(2.0 / math.pi)
        t = torch.tanh(c * (g + 0.044715 * g * g * g))
        a = 0.5 * g * (1 + t)
        da = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g)
    dm32 = dm.to(g.dtype)
    d_up = (dm32 * a).to(up.dtype)
    d_gate = (dm32 * up.to(g.dtype) * da).to(gate.dtype)
    return d_gate, d_up
