"""`patch(model)`: structured LoRA inside an HF transformers (+ PEFT) model, in place; `unpatch`.

Per instance, never per class:
- each PEFT lora.Linear becomes a StructuredPeftLinear: the same object, its class set to a
  subclass whose forward, in the plain case (one active adapter, no dropout, not merged or
  disabled), is mesp's lora_linear (saves x only). PEFT finds its layers by type to save,
  merge or disable them, so the layer must stay a lora.Linear holding its own state;
- each MLP is replaced by a FusedLoRAMLP that adopts its children (names unchanged);
- this model's forward, when given labels, runs the decoder and then the chunked linear
  cross-entropy, with `logits` None; without labels it is the original forward.
Parameter names and order, and what PEFT's save_pretrained writes, are unchanged; unpatch puts
back the original classes, modules (with their current children) and forward.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mesp.errors import MespError
from mesp.nn.functions import Proj, linear_cross_entropy, lora_linear
from mesp.nn.modules import FusedLoRAMLP
from mesp.ops.mlp import ACTIVATIONS, gated_act

log = logging.getLogger("mesp")

FAMILIES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3TextForCausalLM",
    "MistralForCausalLM",
    "SmolLM3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",  # its MLP (one fused gate_up_proj) is not fused: stays transformers'
)
# MLPs whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)).
_MLPS = (
    "LlamaMLP",
    "Qwen2MLP",
    "Qwen3MLP",
    "Gemma3MLP",
    "MistralMLP",
    "SmolLM3MLP",
    "GraniteMLP",
    "Olmo2MLP",
    "Gemma2MLP",
)
_RECORD = "_mesp_patch"


@dataclass
class PatchRecord:
    """What patch changed on one model, by module name: PEFT layers whose class it set,
    module swaps in order as (parent, child name, original), whether forward was replaced, and
    the PEFT layers left alone with the reason."""

    classed: dict[str, nn.Module] = field(default_factory=dict)
    swaps: dict[str, tuple[nn.Module, str, nn.Module]] = field(default_factory=dict)
    loss: bool = False
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [*self.classed, *self.swaps]


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers CausalLM inside model (itself, or a PeftModel's base model)."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    if type(inner).__name__ not in FAMILIES:
        raise MespError(f"mesp.patch supports {', '.join(FAMILIES)}; got {type(inner).__name__}")
    return inner


def _plain_lora(m: Any) -> str:
    """Why PEFT layer m is not the plain case lora_linear computes ("" when it is)."""
    active = list(m.active_adapters)
    a = active[0] if len(active) == 1 else None
    if a is None or a not in m.lora_A:
        return f"active adapters {active}, not exactly one"
    base = m.base_layer
    checks = (
        (not m.merged and not m.disable_adapters, "merged or disabled"),
        (not m.fan_in_fan_out, "fan_in_fan_out"),
        (isinstance(m.lora_dropout[a], nn.Identity), "LoRA dropout"),
        (a not in getattr(m, "lora_variant", {}), "a LoRA variant (DoRA, …)"),
        (m.lora_B[a].bias is None, "lora_bias"),
        (type(base) is nn.Linear, f"base layer {type(base).__name__}"),
        (not any(p.requires_grad for p in base.parameters()), "trainable base layer"),
    )
    return next((why for ok, why in checks if not ok), "")


@functools.cache
def _structured_peft_linear() -> type:
    """StructuredPeftLinear, built on first use so that importing mesp does not import peft."""
    from peft.tuners.lora import Linear as PeftLinear

    class StructuredPeftLinear(PeftLinear):
        """PEFT's lora.Linear whose plain case runs lora_linear (x saved, h recomputed)."""

        def proj(self) -> Proj | None:
            if _plain_lora(self):
                return None
            a = self.active_adapters[0]
            base = self.base_layer
            A, B = self.lora_A[a].weight, self.lora_B[a].weight
            return Proj(base.weight, base.bias, A, B, self.scaling[a])

        def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            p = None if args or kwargs else self.proj()  # adapter_names=…: PEFT's mixed batch
            return super().forward(x, *args, **kwargs) if p is None else lora_linear(x, p)

    StructuredPeftLinear.__module__, StructuredPeftLinear.__qualname__ = (
        __name__,
        "StructuredPeftLinear",
    )
    return StructuredPeftLinear


def __getattr__(name: str) -> Any:
    """mesp.patch.StructuredPeftLinear, made on demand (serializers find the class by name)."""
    if name == "StructuredPeftLinear":
        return _structured_peft_linear()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _peft_linear_type() -> type | None:
    try:
        from peft.tuners.lora import Linear as PeftLinear
    except ImportError:
        return None
    return PeftLinear


def _act_name(act_fn: nn.Module) -> str | None:
    """'silu' or 'gelu_tanh' by probing the activation (its class name differs by version)."""
    z = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64)
    try:
        y = act_fn(z)
    except Exception:  # an activation that cannot take a float64 CPU probe is not ours
        return None
    for name in ACTIVATIONS:
        if torch.allclose(y, gated_act(z, torch.ones_like(z), name), rtol=0, atol=1e-6):
            return name
    return None


def _fusable(mlp: nn.Module) -> str | None:
    """The MLP's activation when it can become a FusedLoRAMLP, else None."""
    if type(mlp).__name__ not in _MLPS or mlp._parameters or mlp._buffers:
        return None
    if not all(
        isinstance(getattr(mlp, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")
    ):
        return None
    act = getattr(mlp, "act_fn", None)
    return _act_name(act) if isinstance(act, nn.Module) else None


def patch(
    model: nn.Module,
    *,
    linears: bool = True,
    mlp: bool = True,
    loss: bool = True,
    mlp_recompute: bool = False,
) -> nn.Module:
    """Swap in mesp's structured LoRA pieces (see the module docstring); returns model.
    mlp_recompute: the fused MLP keeps only its input and redoes gate/up in backward."""
    lm = causal_lm(model)
    if getattr(lm, _RECORD, None) is not None:
        unpatch(model)  # re-patching applies the new options to the original modules
    rec = PatchRecord()
    peft_linear = _peft_linear_type()
    if linears and peft_linear is not None:
        for name, m in lm.named_modules():
            if isinstance(m, peft_linear):
                why = "" if type(m) is peft_linear else f"a {type(m).__name__}"
                why = why or _plain_lora(m)
                if why:
                    rec.skipped[name] = why
                    continue
                m.__class__ = _structured_peft_linear()
                rec.classed[name] = m
    if mlp:
        for name, m in list(lm.named_modules()):
            act = _fusable(m)
            if act is not None:
                parent_name, _, child = name.rpartition(".")
                parent = lm.get_submodule(parent_name)
                rec.swaps[name] = (parent, child, m)
                setattr(parent, child, FusedLoRAMLP(dict(m.named_children()), act, mlp_recompute))
    if loss:
        lm.forward = _ChunkedLossForward(lm)
        rec.loss = True
    for name, why in rec.skipped.items():
        log.warning("mesp.patch left %s as PEFT's layer: %s", name, why)
    setattr(lm, _RECORD, rec)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Put back exactly the classes, modules and forward that patch replaced; returns model.
    A swapped-out module gets the replacement's current children (PEFT may have changed them)."""
    lm = causal_lm(model)
    rec: PatchRecord | None = getattr(lm, _RECORD, None)
    if rec is None:
        return model
    for parent, child, original in reversed(rec.swaps.values()):
        new = parent._modules[child]
        if new is not None:
            for name, sub in new.named_children():
                original._modules[name] = sub
        setattr(parent, child, original)
    structured = _structured_peft_linear() if rec.classed else None
    for m in rec.classed.values():
        if type(m) is structured:
            m.__class__ = structured.__base__
    ours = lm.__dict__.get("forward")
    if rec.loss and isinstance(ours, _ChunkedLossForward):
        if ours.previous is None:
            del lm.forward
        else:
            lm.forward = ours.previous
    elif rec.loss:
        log.warning("mesp.unpatch: forward was wrapped again after patch; left as it is")
    delattr(lm, _RECORD)
    return model


def patch_record(model: nn.Module) -> PatchRecord | None:
    """What patch changed on model, or None when it is not patched."""
    return getattr(causal_lm(model), _RECORD, None)


class _ChunkedLossForward:
    """This CausalLM's forward while patched. With labels (and the stock loss, all positions
    kept, a frozen bias-free nn.Linear head), the decoder and then linear_cross_entropy with
    HF's conventions: labels shifted (or shift_labels as given), ignore_index, loss summed /
    num_items_in_batch under gradient accumulation, Gemma's final_logit_softcapping. Otherwise
    the forward it replaced. Not a module, so it adds no parameters or state-dict keys."""

    def __init__(self, lm: nn.Module) -> None:
        self.lm = lm
        self.previous = lm.__dict__.get("forward")  # an instance-level forward set by others
        # Trainer and generate() read the forward's signature: keep reporting the original.
        self.__signature__ = inspect.signature(lm.forward)

    def _head_ok(self) -> bool:
        head, lm = self.lm.lm_head, self.lm
        return (
            type(head) is nn.Linear
            and head.bias is None
            and not head.weight.requires_grad
            and "_loss_function" not in lm.__dict__  # a user's own loss: let HF call it
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lm = self.lm
        bound = self.__signature__.bind(*args, **kwargs)
        kw: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            var_kw = self.__signature__.parameters[name].kind is inspect.Parameter.VAR_KEYWORD
            kw.update(value if var_kw else {name: value})
        labels = kw.pop("labels", None)
        keep = kw.pop("logits_to_keep", 0)
        if labels is None or not (isinstance(keep, int) and keep == 0) or not self._head_ok():
            fallback = self.previous or functools.partial(type(lm).forward, lm)
            return fallback(*args, **kwargs)
        return_dict = kw.pop("return_dict", None)
        out = lm.model(**kw)  # HF hands the decoder every kwarg but labels / logits_to_keep
        shift_labels = kw.get("shift_labels")
        h, div = out.last_hidden_state, getattr(lm.config, "logits_scaling", 1.0)
        loss = linear_cross_entropy(
            h if div == 1.0 else h / div,  # Granite: logits ÷ s, the head is linear
            lm.lm_head.weight,
            labels if shift_labels is None else shift_labels,
            ignore_index=kw.get("ignore_index", -100),
            shift=shift_labels is None,
            softcap=getattr(lm.config, "final_logit_softcapping", None),
            num_items=kw.get("num_items_in_batch"),
        )
        from transformers.modeling_outputs import CausalLMOutputWithPast

        names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
        rest = {k: v for k, v in out.items() if k in names and k not in ("loss", "logits")}
        result = CausalLMOutputWithPast(loss=loss, logits=None, **rest)
        if return_dict is None:
            return_dict = getattr(lm.config, "return_dict", True)
        return result if return_dict else result.to_tuple()


__all__ = ["FAMILIES", "PatchRecord", "causal_lm", "patch", "patch_record", "unpatch"]
