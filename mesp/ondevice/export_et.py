"""`mesp export`'s programs: every program of a MeSP step as an ExecuTorch .pte.

Programs (mesp.ondevice.steps, lowered by mesp.ondevice.lower), one set per block structure:
  embed            weights/*, ids -> h
  <gid>.forward    weights/*, lora/*, ctx/*, x -> y                 (nothing saved)
  <gid>.backward   weights/*, lora/*, ctx/*, x, dy -> dx, grad/*    (recompute + hand backward)
  loss_start       weights/norm.weight, h, rows -> hs, m, s, tz, [ctg], acc   (trained rows)
  loss_slice       head/* (one vocabulary slice), v0, tgt, hs, state -> state (per slice)
  loss_tail        the same for the last, shorter slice (when the chunk does not divide V)
  loss_finish      weights/*, h, rows, tgt, state, norm -> loss, dh
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

from mesp.models.transformer import CausalLM
from mesp.ondevice.contract import ET_VERSION, fnv1a64
from mesp.ondevice.edge_programs import EdgeSpec, head_slice
from mesp.ondevice.lower import io_rows, lower
from mesp.ondevice.programs import BlockSpec, WeightSpec, block_parts, example_hidden
from mesp.ondevice.steps import (
    ADAMW_SCALARS,
    Flat,
    adamw_step,
    backward_step,
    embed_step,
    forward_step,
    loss_finish_step,
    loss_slice_step,
    loss_start_step,
    sgd_step,
)
from mesp.ops.gated_kernel import GATED_OPS
from mesp.ops.qmatmul import KERNEL_BITS, KERNEL_OPS
from mesp.quant import packed_bytes


def edge_weights(w: dict[str, Tensor]) -> dict[str, Tensor]:
    """Frozen tensors as the edge programs read them: packed int32 words as their bytes."""
    return {k: packed_bytes(v) if v.dtype == torch.int32 else v for k, v in w.items()}


def edge_block_spec(
    bs: BlockSpec, tile: int, block_bytes: int = 0, kernel: bool = False
) -> BlockSpec:
    """The block spec with the edge formulations: core-ATen unpack, query-tiled attention, and
    for the quantized weights either mesp's kernel ops (`kernel`: mesp.ops.qmatmul, dequantized
    a block at a time inside the runtime) or, with block_bytes, dequantized in the graph in
    blocks of at most that many fp32 bytes (mesp.ops.matmul.TracedBlocks: XNNPACK then holds a
    block's values and packing, not a whole matrix's; 0: whole)."""
    bb = block_bytes or None

    def edge(ws: WeightSpec) -> WeightSpec:
        own = kernel and ws.quant is not None and ws.quant.bits in KERNEL_BITS
        return replace(ws, core_aten=True, block_bytes=bb, kernel=own)

    lins = tuple((n, edge(ws)) for n, ws in bs.linears)
    return replace(bs, linears=lins, attn_tile=tile, act_kernel=kernel)


def edge_spec(es: EdgeSpec, kernel: bool = False) -> EdgeSpec:
    """The loss and embedding spec with the core-ATen unpack; with `kernel`, a packed head's
    slice products as mesp's kernel ops (the slice is never dequantized whole)."""
    q = es.head.quant
    own = kernel and q is not None and q.bits in KERNEL_BITS
    head = replace(es.head, core_aten=True, kernel=own)
    return replace(es, embed=replace(es.embed, core_aten=True), head=head)


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


def _loss_programs(
    progs: _Programs, es: EdgeSpec, w: dict[str, Tensor], h: Tensor, max_rows: int
) -> dict[str, Any]:
    """The loss as a loop the drivers run: loss_start (final norm, trained rows, the state),
    loss_slice once per vocabulary slice of `chunk` rows (loss_tail for the last, shorter one),
    loss_finish (loss, dh, final-norm backward). Only the slice program sees head rows, so the
    planned memory is one slice's whatever the vocabulary; it is XNNPACK-delegated (its two
    matmuls are the loss's work), start and finish run on portable kernels (row-sized).
    Returns run_config's "executorch.loss" section."""
    vocab = es.vocab
    chunk = es.vocab_chunk or vocab
    n = min(max_rows, 3)
    rows_t, tgt = torch.arange(n), torch.zeros(n, dtype=torch.long)
    dim = ("rows", max_rows)
    norm_w = {"weights/norm.weight": w["norm.weight"]}
    start = loss_start_step(es)({**norm_w, "h": h, "rows": rows_t})
    state = [k for k in start if k != "hs"]
    progs.add(
        "loss_start", loss_start_step(es), {**norm_w, "h": h, "rows": rows_t},
        list(start), {"rows": dim}, dict.fromkeys(start, dim), False,
    )  # fmt: skip
    slices = {"loss_slice": chunk}
    if vocab % chunk:
        slices["loss_tail"] = vocab % chunk
    for name, width in slices.items():
        head = {f"head/{k}": t for k, t in head_slice(w, es.head, 0, width).items()}
        ins = {**head, "v0": torch.tensor(0), "tgt": tgt, **start}
        progs.add(
            name, loss_slice_step(es), ins, state,
            {k: dim for k in ("tgt", *start)}, dict.fromkeys(state, dim),
        )  # fmt: skip
    keys = [f"{es.head.prefix}.{k}" for k in head_slice(w, es.head, 0, 1)]
    fin = {**norm_w, **{f"weights/{k}": w[k] for k in keys}, "h": h, "rows": rows_t, "tgt": tgt}
    fin.update({k: start[k] for k in state})
    fin["norm"] = torch.tensor(float(n))
    progs.add(
        "loss_finish", loss_finish_step(es), fin, ["loss", "dh"],
        {k: dim for k in ("rows", "tgt", *state)}, {"loss": dim}, False,
    )  # fmt: skip
    file = "head.safetensors" if es.head.prefix == "lm_head" else "embedding.safetensors"
    return {"vocab": vocab, "chunk": chunk, "head_file": file, "head_prefix": es.head.prefix}


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
    weight_block_bytes: int = 0,
    kernel: bool = True,
) -> dict[str, Any]:
    """Lower every program of a step; returns run_config.json's "executorch" section. With
    `kernel` (and no weight_block_bytes), the block programs call mesp's kernel ops for their
    packed (4/5/6/8-bit) matrices; the section's "kernels" names them (a driver must bring them)."""
    kernel = kernel and not weight_block_bytes
    used = False
    S, B, hid = seq_len, batch_size, model.config.hidden_size
    x, g = example_hidden(model, B, S)
    progs = _Programs(writer, delegate)
    max_lora = 1
    for (bs, ltype, *_), (gid, i) in groups.items():
        w, lora = block_parts(model.layers[i])
        w = edge_weights(w)
        max_lora = max([max_lora, *(t.numel() for t in lora.values())])
        ebs = edge_block_spec(bs, attn_tile, weight_block_bytes, kernel)
        used = used or ebs.act_kernel or any(ws.kernel for _, ws in ebs.linears)
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
    ees = edge_spec(es, kernel)
    used = used or ees.head.kernel
    ids = torch.zeros(B, S, dtype=torch.long)
    progs.add(
        "embed",
        embed_step(ees),
        {**{f"weights/{k}": v for k, v in embed_w.items()}, "ids": ids},
        ["h"],
    )
    loss_w = head_w if es.head.prefix == "lm_head" else {**head_w, **embed_w}  # tied: the embedding
    loss = _loss_programs(progs, ees, loss_w, x, B * S)
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
        "version": ET_VERSION,
        "backend": "xnnpack" if delegate else "portable",
        "attn_tile": attn_tile,
        "weight_block_bytes": weight_block_bytes,
        "kernels": [*KERNEL_OPS, *GATED_OPS] if used else [],
        "loss": loss,
        "programs": progs.rows,
        "planned_bytes_max": max(sum(r["planned_bytes"]) for r in progs.rows.values()),
    }


__all__ = ["edge_block_spec", "edge_spec", "export_executorch"]
