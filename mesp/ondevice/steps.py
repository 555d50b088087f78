"""The programs of one MeSP step for edge runtimes, with flat named inputs and outputs.

An ExecuTorch program takes a flat list of tensors. Each program here is a function of one
dict, name -> tensor, in the naming of the runner contract (run_config.json "executorch"):
`weights/<key>` frozen tensors, `lora/<key>` adapter tensors, `ctx/<key>` RoPE tables and mask,
and plain names for activations (`ids`, `x`, `dy`, `h`, `rows`, `tgt`, `norm`) and optimizer
state (`p`, `g`, `m`, `v`). `Flat` turns one into an nn.Module of positional tensors in a fixed,
recorded order, which is all a native runner needs to drive it.

The block programs are mesp.ondevice.programs' block_forward and programs_backward's
block_backward (the engine's ops, op for op) with two edge formulations switched on by the
spec: the core-ATen unpack of packed codes and the exact query-tiled attention. The backward
program recomputes the forward's saved tensors itself (recompute + hand backward in one graph:
the planner frees each saved tensor at its last use, where two programs would hold all of them
as one program's outputs).

The optimizer updates replay torch.optim's single-tensor CPU kernels (torch 2.13) in fp32:
  SGD    p ← p + (−lr)·(g + wd·p)
  AdamW  p ← p·(1 − lr·wd);  m ← m + (1 − β1)(g − m)  (lerp, weight < ½);
         v ← v·β2 + ((1 − β2)·g)·g  (addcmul);  d ← √v / √(1 − β2ᵗ) + ε;
         p ← p − (lr/(1 − β1ᵗ))·m / d  (addcdiv)
with the step-dependent scalars computed by the host in double and passed as 0-d fp32 tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mesp.ondevice.contract import ADAMW_SCALARS, adamw_scalars
from mesp.ondevice.edge_programs import EdgeSpec, embed, loss_finish, loss_slice, loss_start
from mesp.ondevice.programs import BlockSpec, block_forward
from mesp.ondevice.programs_backward import block_backward

Named = dict[str, Tensor]


def _group(d: Named, prefix: str) -> Named:
    n = len(prefix)
    return {k[n:]: v for k, v in d.items() if k.startswith(prefix)}


def embed_step(es: EdgeSpec) -> Callable[[Named], Named]:
    def run(d: Named) -> Named:
        return {"h": embed(es, _group(d, "weights/"), d["ids"])}

    return run


def forward_step(bs: BlockSpec) -> Callable[[Named], Named]:
    """x -> y: the block forward, nothing saved (the runner keeps only x)."""

    def run(d: Named) -> Named:
        w, lora, ctx = _group(d, "weights/"), _group(d, "lora/"), _group(d, "ctx/")
        return {"y": block_forward(bs, w, lora, d["x"], ctx, None)}

    return run


def backward_step(bs: BlockSpec, lora_names: list[str]) -> Callable[[Named], Named]:
    """(x, dy) -> (dx, grad/<key>...): recompute the saved tensors from x, then hand backward."""

    def run(d: Named) -> Named:
        w, lora, ctx = _group(d, "weights/"), _group(d, "lora/"), _group(d, "ctx/")
        # Packed bytes become floats once here: the recompute and the backward both read gate
        # and up (and q, k, v), and each read would cast again. The casts run outside XNNPACK
        # (it has no uint8 -> fp32 convert) and all feed its one large partition, so all are
        # in the arena together: at Qwen2.5-0.5B, 5 casts of 8.3 MiB become 3 (arena 76.6 ->
        # 60.0 MiB). The values are the bytes, exactly; the unpack's own .to() is then a no-op.
        # (The kernel ops read the bytes themselves: their weights are not cast.)
        own = {f"{ws.prefix}.weight" for _, ws in bs.linears if ws.kernel}
        w = {
            k: v.to(d["x"].dtype) if v.dtype == torch.uint8 and k not in own else v
            for k, v in w.items()
        }
        tape: Named = {}
        block_forward(bs, w, lora, d["x"], ctx, tape)
        dx, grads = block_backward(bs, tape, d["dy"], d["x"], w, lora, ctx)
        return {"dx": dx, **{f"grad/{k}": grads[k] for k in lora_names}}

    return run


def loss_start_step(es: EdgeSpec) -> Callable[[Named], Named]:
    """(h, rows) -> hs and the online-logsumexp state (m, s, tz, [ctg], acc)."""

    def run(d: Named) -> Named:
        return loss_start(es, _group(d, "weights/"), d["h"], d["rows"])

    return run


def loss_slice_step(es: EdgeSpec) -> Callable[[Named], Named]:
    """(head/<key> rows of one slice, v0, tgt, hs, state) -> state: one vocabulary slice; the
    drivers call it once per slice with the state it returned last."""

    def run(d: Named) -> Named:
        return loss_slice(es, _group(d, "head/"), d, d["tgt"], d["v0"])

    return run


def loss_finish_step(es: EdgeSpec) -> Callable[[Named], Named]:
    """(h, rows, tgt, state, norm) -> per-row losses and dh."""

    def run(d: Named) -> Named:
        loss, dh = loss_finish(es, _group(d, "weights/"), d["h"], d["rows"], d["tgt"], d, d["norm"])
        return {"loss": loss, "dh": dh}

    return run


def sgd_step(d: Named) -> Named:
    p = d["p"]
    return {"p": p + torch.neg(d["lr"]) * (d["g"] + d["weight_decay"] * p)}


def adamw_step(d: Named) -> Named:
    p, g, m, v = d["p"] * d["decay"], d["g"], d["m"], d["v"]
    m = m + d["one_minus_beta1"] * (g - m)
    v = v * d["beta2"] + (d["one_minus_beta2"] * g) * g
    denom = torch.sqrt(v) / d["bc2_sqrt"] + d["eps"]
    return {"p": p - (d["step_size"] * m) / denom, "m": m, "v": v}


class Flat(nn.Module):
    """fn(dict) -> dict as a module of positional tensors: inputs in `in_names` order, outputs
    as a tuple in `out_names` order (both recorded in run_config.json)."""

    def __init__(
        self, fn: Callable[[Named], Named], in_names: list[str], out_names: list[str]
    ) -> None:
        super().__init__()
        self.fn, self.in_names, self.out_names = fn, list(in_names), list(out_names)

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        out = self.fn(dict(zip(self.in_names, tensors, strict=True)))
        return tuple(out[k] for k in self.out_names)


__all__ = [
    "ADAMW_SCALARS",
    "Flat",
    "adamw_scalars",
    "adamw_step",
    "backward_step",
    "embed_step",
    "forward_step",
    "loss_finish_step",
    "loss_slice_step",
    "loss_start_step",
    "sgd_step",
]
