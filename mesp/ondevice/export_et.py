"""`mesp export --target executorch`: every program of a MeSP step as an ExecuTorch .pte.

Programs (mesp.ondevice.steps, lowered by mesp.ondevice.lower), one set per block structure:
  embed            weights/*, ids -> h
  <gid>.forward    weights/*, lora/*, ctx/*, x -> y                 (nothing saved)
  <gid>.backward   weights/*, lora/*, ctx/*, x, dy -> dx, grad/*    (recompute + hand backward)
  loss             weights/*, h, rows, tgt, norm -> loss, dh        (trained rows only, dynamic)
  sgd, adamw       one flattened LoRA tensor (dynamic length) and its state -> updated
Frozen weights never enter a program: they are inputs, read by the runner from the per-block
safetensors files that `mesp export` writes, just before the block runs. run_config.json's
"executorch" section lists each program's file, FNV-1a 64 digest, planned memory and its inputs
and outputs in order: the whole contract of the native runner (runtime/) and of the Python
driver (mesp.ondevice.et_driver).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from mesp.errors import MespError
from mesp.models.transformer import CausalLM
from mesp.ondevice.edge_programs import EdgeSpec
from mesp.ondevice.lower import fnv1a64, io_rows, lower
from mesp.ondevice.programs import BlockSpec, block_parts, example_hidden
from mesp.ondevice.steps import (
    ADAMW_SCALARS,
    Flat,
    adamw_step,
    backward_step,
    embed_step,
    forward_step,
    loss_step,
    sgd_step,
)
from mesp.quant import packed_bytes

VERSION = 1


def edge_weights(w: dict[str, Tensor]) -> dict[str, Tensor]:
    """Frozen tensors as the edge programs read them: packed int32 words as their bytes."""
    return {k: packed_bytes(v) if v.dtype == torch.int32 else v for k, v in w.items()}


def edge_block_spec(bs: BlockSpec, tile: int) -> BlockSpec:
    """The block spec with the edge formulations: core-ATen unpack, query-tiled attention."""
    lins = tuple((n, replace(ws, core_aten=True)) for n, ws in bs.linears)
    return replace(bs, linears=lins, attn_tile=tile)


def edge_spec(es: EdgeSpec) -> EdgeSpec:
    return replace(
        es, embed=replace(es.embed, core_aten=True), head=replace(es.head, core_aten=True)
    )


class _Programs:
    """Lowers programs and writes them; collects their run_config rows."""

    def __init__(self, writer: Any, delegate: bool) -> None:
        self.writer, self.delegate, self.rows = writer, delegate, {}

    def add(
        self,
        name: str,
        fn: Any,
        inputs: dict[str, Tensor],
        out_names: list[str],
        dynamic: dict[str, tuple[str, int]] | None = None,
        out_dynamic: dict[str, tuple[str, int]] | None = None,
        delegate: bool = True,
    ) -> None:
        names, tensors = list(inputs), [t.contiguous() for t in inputs.values()]
        dyn = {names.index(k): v for k, v in (dynamic or {}).items()}
        prog = Flat(fn, names, out_names)
        with torch.no_grad():
            outs = list(prog(*tensors))
        low = lower(prog, tensors, dyn, self.delegate and delegate)
        rel = f"pte/{name}.pte"
        self.writer.path(rel).write_bytes(low.pte)
        odyn = {out_names.index(k): v for k, v in (out_dynamic or {}).items()}
        self.rows[name] = {
            "pte": rel,
            "size": len(low.pte),
            "fnv1a64": fnv1a64(low.pte),
            "method": "forward",
            "planned_bytes": low.planned,
            "delegate_calls": low.delegated,
            "inputs": io_rows(names, tensors, dyn),
            "outputs": io_rows(out_names, outs, odyn),
        }


def export_executorch(
    model: CausalLM,
    groups: dict[Any, tuple[str, int]],
    ctx: dict[str, dict[str, Tensor]],
    es: EdgeSpec,
    embed_w: dict[str, Tensor],
    head_w: dict[str, Tensor],
    seq_len: int,
    batch_size: int,
    attn_tile: int,
    writer: Any,
    delegate: bool = True,
) -> dict[str, Any]:
    """Lower every program of a step; returns run_config.json's "executorch" section."""
    if model.dtype != torch.float32:
        raise MespError("--target executorch exports float32 programs: load with --dtype float32")
    S, B, hid = seq_len, batch_size, model.config.hidden_size
    x, g = example_hidden(model, B, S)
    progs = _Programs(writer, delegate)
    max_lora = 1
    for (bs, ltype, *_), (gid, i) in groups.items():
        w, lora = block_parts(model.layers[i])
        w = edge_weights(w)
        max_lora = max([max_lora, *(t.numel() for t in lora.values())])
        ebs = edge_block_spec(bs, attn_tile)
        named = {
            **{f"weights/{k}": v for k, v in w.items()},
            **{f"lora/{k}": v for k, v in lora.items()},
            **{f"ctx/{k}": v for k, v in ctx[ltype].items()},
        }
        progs.add(f"{gid}.forward", forward_step(ebs), {**named, "x": x}, ["y"])
        outs = ["dx", *(f"grad/{k}" for k in lora)]
        dy = torch.randn(B, S, hid, generator=g).to(model.dtype) * 1e-3
        progs.add(
            f"{gid}.backward", backward_step(ebs, list(lora)), {**named, "x": x, "dy": dy}, outs
        )
    ees = edge_spec(es)
    ids = torch.zeros(B, S, dtype=torch.long)
    progs.add(
        "embed",
        embed_step(ees),
        {**{f"weights/{k}": v for k, v in embed_w.items()}, "ids": ids},
        ["h"],
    )
    loss_w = head_w if es.head.prefix == "lm_head" else {**head_w, **embed_w}  # tied: the embedding
    n = min(B * S, 3)
    rows_d = {"rows": ("rows", B * S), "tgt": ("rows", B * S)}
    loss_in = {
        **{f"weights/{k}": v for k, v in loss_w.items()},
        "h": x,
        "rows": torch.arange(n),
        "tgt": torch.zeros(n, dtype=torch.long),
        "norm": torch.tensor(float(n)),
    }
    # The loss runs on ExecuTorch's own kernels: delegated, its plan keeps every vocabulary
    # slice's dequantized rows and logits alive at once (819.6 MiB at Qwen2.5-0.5B's 151,936
    # tokens, chunk 8192, whether XNNPACK groups the ops or takes each matmul alone), where the
    # undelegated program reuses one slice's memory (38.6 MiB at chunk 4096).
    progs.add(
        "loss", loss_step(ees), loss_in, ["loss", "dh"], rows_d, {"loss": ("rows", B * S)}, False
    )
    m = min(max_lora, 5)
    vec = {k: torch.randn(m, generator=g) for k in ("p", "g", "m")}
    vec["v"] = torch.rand(m, generator=g)
    one = lambda v: torch.tensor(float(v))  # noqa: E731
    dim = ("numel", max_lora)
    sgd_in = {"p": vec["p"], "g": vec["g"], "lr": one(1e-3), "weight_decay": one(0.0)}
    progs.add("sgd", sgd_step, sgd_in, ["p"], {"p": dim, "g": dim}, {"p": dim})
    adam_in = {**vec, **{k: one(0.5) for k in ADAMW_SCALARS}}
    vdyn = {k: dim for k in ("p", "g", "m", "v")}
    progs.add(
        "adamw", adamw_step, adam_in, ["p", "m", "v"], vdyn, {k: dim for k in ("p", "m", "v")}
    )
    return {
        "version": VERSION,
        "backend": "xnnpack" if delegate else "portable",
        "attn_tile": attn_tile,
        "programs": progs.rows,
        "planned_bytes_max": max(sum(r["planned_bytes"]) for r in progs.rows.values()),
    }


__all__ = ["edge_block_spec", "edge_spec", "export_executorch"]
