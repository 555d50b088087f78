"""The torch.export (.pt2) programs of a torch-target export: the block forward, recompute and
backward per group of identical blocks, the embedding and the loss, each captured with every
tensor an argument and saved as its graph alone (no weight, no pickle)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mesp.errors import MespError
from mesp.models.transformer import CausalLM
from mesp.ondevice.artifact_files import Writer
from mesp.ondevice.edge_programs import EdgeSpec, Embed, LossAndGrad
from mesp.ondevice.programs import (
    BlockBackward,
    BlockForward,
    block_forward,
    block_parts,
    example_hidden,
)


def export_program(module: torch.nn.Module, args: tuple, dynamic: Any = None) -> Any:
    try:
        return torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # torch.export raises many types; keep the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MespError(f"torch.export failed for {type(module).__name__}: {first}") from e


def _check_no_constants(ep: Any, rel: str) -> None:
    """Every tensor of a program must be an argument: a lifted constant or a parameter/buffer
    would be a weight copy stored inside the .pt2 (and loaded beside the safetensors one)."""
    baked = [*ep.state_dict, *ep.constants]
    if baked:
        raise MespError(f"{rel}: the program captured tensors as constants: {sorted(baked)[:3]}")


def _save_program(ep: Any, rel: str, writer: Writer, eid: str) -> dict[str, Any]:
    """The .pt2 holds the graph (JSON) and no tensor: the example inputs torch.export keeps
    (they include the frozen weights it was traced with) would be saved as a torch.save pickle,
    data/sample_inputs/model.pt, and loaded back with torch.load; they are dropped first."""
    _check_no_constants(ep, rel)
    ep.example_inputs = None
    torch.export.save(ep, str(writer.path(rel)), extra_files={"export_id": eid})
    return {"pt2": rel}


def export_functions(
    model: CausalLM,
    groups: dict[Any, tuple[str, int]],
    ctx: dict[str, dict[str, Tensor]],
    es: EdgeSpec,
    embed_w: dict[str, Tensor],
    head_w: dict[str, Tensor],
    seq_len: int,
    batch_size: int,
    writer: Writer,
    eid: str,
) -> dict[str, Any]:
    S, B = seq_len, batch_size
    x, _ = example_hidden(model, B, S)
    fns: dict[str, Any] = {"blocks": {}}
    for (bs, ltype, *_), (gid, i) in groups.items():
        w, lora = block_parts(model.layers[i])
        c = ctx[ltype]
        with torch.no_grad():
            tape: dict[str, Tensor] = {}
            block_forward(bs, w, lora, x, c, tape)
            saved = dict(sorted(tape.items()))
        names = {"weights": list(w), "lora": list(lora), "ctx": list(c), "saved": list(saved)}
        fwd = export_program(BlockForward(bs, saved=False), (w, lora, x, c))
        rec = export_program(BlockForward(bs, saved=True), (w, lora, x, c))
        bwd = export_program(BlockBackward(bs), (saved, x.clone(), x, w, lora, c))
        progs = {"forward": fwd, "recompute": rec, "backward": bwd}
        fns["blocks"][gid] = {
            "layer_type": ltype,
            "inputs": names,
            **{k: _save_program(p, f"fns/{gid}_{k}.pt2", writer, eid) for k, p in progs.items()},
        }
    ids = torch.zeros(B, S, dtype=torch.long)
    ep = export_program(Embed(es), (embed_w, ids))
    fns["embed"] = _save_program(ep, "fns/embed.pt2", writer, eid)
    fns["embed"]["inputs"] = {"weights": list(embed_w)}
    n = min(B * S, 3)  # trained rows vary per batch: a dynamic dimension, 1 ≤ n ≤ B·S
    rows = torch.arange(n)
    tgt = torch.zeros(n, dtype=torch.long)
    norm = torch.tensor(float(n), dtype=torch.float32)
    dim = torch.export.Dim("rows", min=1, max=B * S)
    loss_w = head_w if es.head.prefix == "lm_head" else {**head_w, **embed_w}  # tied: the embedding
    dyn = ({k: None for k in loss_w}, None, {0: dim}, {0: dim}, None)
    ep = export_program(LossAndGrad(es), (loss_w, x, rows, tgt, norm), dyn)
    fns["loss"] = _save_program(ep, "fns/loss.pt2", writer, eid)
    fns["loss"]["inputs"] = {"weights": list(loss_w)}
    return fns
