"""Drop-in modules over mesp.nn.functions, for users' own PyTorch training loops.

Children keep PEFT's names and order (base_layer, lora_A[adapter], lora_B[adapter], …), so the
state-dict entries are PEFT's. (mesp.patch keeps PEFT's own layer objects instead: PEFT finds
its layers by type to save, merge or disable them.) A base is an nn.Linear with a frozen weight
or a mesp FrozenWeight (dense, or packed codes dequantized on the fly in forward and again
in backward).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from mesp.errors import MespError
from mesp.models.linear import FrozenWeight
from mesp.models.linear import Linear as MespLinear
from mesp.nn.functions import (
    Proj,
    linear_cross_entropy,
    lora_gated_mlp,
    lora_linear,
    lora_shared_input,
)
from mesp.ops.mlp import gated_act


def _frozen_base(layer: nn.Module) -> Proj:
    """The frozen part of a projection: nn.Linear's weight and bias, or a FrozenWeight."""
    if isinstance(layer, FrozenWeight):
        bias = layer.bias if isinstance(layer, MespLinear) else None
        return Proj(layer, bias)
    if isinstance(layer, nn.Linear):
        return Proj(layer.weight, layer.bias)
    raise MespError(f"a base layer must be nn.Linear or FrozenWeight, got {type(layer).__name__}")


class StructuredLoRALinear(nn.Module):
    """y = x Wᵀ + b + s·(x Aᵀ)Bᵀ that saves x alone for backward (h = x Aᵀ is recomputed).

    `children` are PEFT's, in order: at least base_layer, lora_A and lora_B, the latter two
    ModuleDicts of bias-free nn.Linear keyed by adapter name; others (lora_dropout, …) are kept
    only so that names and parameter order match the layer they came from."""

    def __init__(self, children: Mapping[str, nn.Module], adapter: str, scaling: float) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        for name in ("base_layer", "lora_A", "lora_B"):
            if name not in self._modules:
                raise MespError(f"StructuredLoRALinear needs a {name!r} child")
        self.adapter, self.scaling = adapter, float(scaling)
        self.proj()  # fail now, not mid-training, on a trainable base or a missing adapter

    @classmethod
    def wrap(
        cls, base_layer: nn.Module, rank: int, alpha: float, adapter: str = "default"
    ) -> StructuredLoRALinear:
        """A fresh adapter on base_layer (frozen here), initialised as PEFT does: nn.Linear's
        own init for A (Kaiming-uniform, a=√5), zeros for B, so training starts at the base."""
        base_layer.requires_grad_(False)
        base = _frozen_base(base_layer).base
        if isinstance(base, FrozenWeight):
            (out_f, in_f), dev = (base.out_features, base.in_features), base.weight.device
        else:
            (out_f, in_f), dev = base.shape, base.device
        a = nn.Linear(in_f, rank, bias=False, dtype=base.dtype, device=dev)
        b = nn.Linear(rank, out_f, bias=False, dtype=base.dtype, device=dev)
        nn.init.zeros_(b.weight)
        children = {
            "base_layer": base_layer,
            "lora_A": nn.ModuleDict({adapter: a}),
            "lora_B": nn.ModuleDict({adapter: b}),
        }
        return cls(children, adapter, alpha / rank)

    def proj(self) -> Proj:
        frozen = _frozen_base(self.base_layer)
        a, b = self.lora_A[self.adapter], self.lora_B[self.adapter]
        if not isinstance(a, nn.Linear) or not isinstance(b, nn.Linear) or b.bias is not None:
            raise MespError("lora_A / lora_B must be bias-free nn.Linear layers")
        return Proj(frozen.base, frozen.bias, a.weight, b.weight, self.scaling)

    def forward(self, x: Tensor) -> Tensor:
        return lora_linear(x, self.proj())

    def extra_repr(self) -> str:
        return f"adapter={self.adapter!r}, scaling={self.scaling:g}"


def projection(layer: nn.Module) -> Proj | None:
    """What the fused functions need from a projection, or None when it is not expressible as
    one (a trainable base, several active PEFT adapters, …; callers then run the modules).
    Takes a StructuredLoRALinear, a frozen nn.Linear / FrozenWeight (a mesp Linear brings its
    own lora_A, lora_B), or any module with a `proj() -> Proj | None` method."""
    if isinstance(layer, MespLinear) and layer.lora_A is not None:
        return Proj(layer, layer.bias, layer.lora_A, layer.lora_B, layer.lora_scale)
    if isinstance(layer, (FrozenWeight, nn.Linear)):
        if any(p.requires_grad for p in layer.parameters()):
            return None
        return _frozen_base(layer)
    proj = getattr(layer, "proj", None)
    return proj() if callable(proj) else None


class FusedLoRAMLP(nn.Module):
    """down(act(gate(x)) · up(x)) as one autograd node that saves x, gate and up (N×F each)
    instead of autograd's gate, act(gate), up and their product; recompute=True keeps only x
    and redoes the two projections in backward (less memory, ~1/3 more MLP compute).

    `children` must include gate_proj, up_proj and down_proj (and act_fn, if any, is what a
    projection that `projection` cannot express falls back to); act is 'silu' or 'gelu_tanh'."""

    def __init__(self, children: Mapping[str, nn.Module], act: str, recompute: bool = False):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        for name in ("gate_proj", "up_proj", "down_proj"):
            if name not in self._modules:
                raise MespError(f"FusedLoRAMLP needs a {name!r} child")
        self.act, self.recompute = act, recompute

    def forward(self, x: Tensor) -> Tensor:
        g, u, d = (projection(m) for m in (self.gate_proj, self.up_proj, self.down_proj))
        if g is None or u is None or d is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
            act_fn = self._modules.get("act_fn")
            m = gated_act(gate, up, self.act) if act_fn is None else act_fn(gate) * up
            return self.down_proj(m)
        return lora_gated_mlp(x, g, u, d, self.act, self.recompute)

    def extra_repr(self) -> str:
        return f"act={self.act!r}, recompute={self.recompute}"


class FusedLoRAProjections(nn.Module):
    """Several projections of one input, e.g. q/k/v: forward(x) -> (q, k, v). One x is saved
    for all of them and backward forms one dx. Children are the projections, in output order."""

    def __init__(self, children: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        projs = [projection(m) for m in self.children()]
        if any(p is None for p in projs):
            return tuple(m(x) for m in self.children())
        return lora_shared_input(x, projs)  # type: ignore[arg-type]


class ChunkedLMHeadLoss(nn.Module):
    """loss(h, labels): mean cross-entropy of h through a frozen LM head (nn.Linear or
    FrozenWeight), never forming (tokens × vocab) logits. See linear_cross_entropy."""

    def __init__(self, head: nn.Module, softcap: float | None = None, shift: bool = True):
        super().__init__()
        self.head, self.softcap, self.shift = head, softcap, shift

    def forward(self, h: Tensor, labels: Tensor, **kw: Any) -> Tensor:
        frozen = _frozen_base(self.head)
        if frozen.bias is not None:
            raise MespError("an LM head with a bias is not supported")
        return linear_cross_entropy(
            h, frozen.base, labels, softcap=self.softcap, shift=self.shift, **kw
        )
