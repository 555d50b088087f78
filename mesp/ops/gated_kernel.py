"""mesp::gated_act, mesp::gated_act_dgate, mesp::gated_act_dup: the MLP's gated activation and its
gradients as one op each, for the on-device programs (mesp export).

  gated_act(gate, up)            m      = act(gate) · up
  gated_act_dgate(dm, gate, up)  d_gate = act'(gate) · (dm · up)
  gated_act_dup(dm, gate)        d_up   = act(gate) · dm             all (..., F), fp32

ExecuTorch has no kernel for ATen's fused silu_backward / gelu_backward, so the programs wrote
the gradients out in elementwise ops (mesp.ops.mlp._written_out): a chain of (tokens ×
intermediate) temporaries, σ(g), g·σ(g), 1 − σ(g), …, five MB each at seq 256 on Qwen2.5-0.5B,
held in the planned arena or in XNNPACK's workspace. The runtimes' kernels
(mesp/ondevice/gated_act.cpp) compute each output in one pass, value by value in the order of
operations of the ATen kernels the engine runs (mesp.ops.mlp.gated_act / gated_act_backward:
silu, silu_backward, gelu and gelu_backward with tanh), so only the output is allocated and the
values are the engine's but for libm's exp / tanh against SLEEF's. Here each op's reference is
the engine's eager op (what runs if a program is evaluated in PyTorch; torch.export keeps the op
whole); the `.out` overloads bind to the runtime kernels. `act` indexes ACTIVATIONS.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mesp.ops.mlp import ACTIVATIONS, _act, _act_backward

GATED_OPS = ("mesp::gated_act.out", "mesp::gated_act_dgate.out", "mesp::gated_act_dup.out")

_LIB = torch.library.Library("mesp", "FRAGMENT")
_SCHEMAS = {
    "gated_act": "Tensor gate, Tensor up, int act",
    "gated_act_dgate": "Tensor dm, Tensor gate, Tensor up, int act",
    "gated_act_dup": "Tensor dm, Tensor gate, int act",
}
for _op, _args in _SCHEMAS.items():
    _LIB.define(f"{_op}({_args}) -> Tensor")
    _LIB.define(f"{_op}.out({_args}, *, Tensor(a!) out) -> Tensor(a!)")


def _m(gate: Tensor, up: Tensor, act: int) -> Tensor:
    return _act(gate, ACTIVATIONS[act]) * up


def _dgate(dm: Tensor, gate: Tensor, up: Tensor, act: int) -> Tensor:
    return _act_backward(dm * up, gate, ACTIVATIONS[act])


def _dup(dm: Tensor, gate: Tensor, act: int) -> Tensor:
    return _act(gate, ACTIVATIONS[act]) * dm


def _out(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:  # the .out overload
    def run(*args: object, out: Tensor) -> Tensor:
        y = fn(*args)
        out.resize_(y.shape)
        return out.copy_(y)

    return run


def _meta(first: Tensor, *args: object) -> Tensor:  # every tensor argument is (..., F)
    return torch.empty_like(first)


for _op, _fn in (("gated_act", _m), ("gated_act_dgate", _dgate), ("gated_act_dup", _dup)):
    _LIB.impl(_op, _fn, "CompositeExplicitAutograd")
    _LIB.impl(f"{_op}.out", _out(_fn), "CompositeExplicitAutograd")
    _LIB.impl(_op, _meta, "Meta")


def gated(gate: Tensor, up: Tensor, act: str) -> Tensor:
    """act(gate) · up as mesp::gated_act."""
    return torch.ops.mesp.gated_act(gate, up, ACTIVATIONS.index(act))


def gated_backward(dm: Tensor, gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """(d_gate, d_up) as mesp::gated_act_dgate and mesp::gated_act_dup."""
    i = ACTIVATIONS.index(act)
    d_gate = torch.ops.mesp.gated_act_dgate(dm, gate, up, i)
    return d_gate, torch.ops.mesp.gated_act_dup(dm, gate, i)


__all__ = ["GATED_OPS", "gated", "gated_backward"]
