"""`mesp export`: per-block artifacts that `mesp.runner` trains from without any model code.

The split follows the original MeSP (Python exports, a Swift runner trains): frozen weights as one
safetensors file per block, read only while that block runs; the block forward, its recompute
(forward + the saved tensors) and its hand backward as `torch.export` programs (.pt2) whose every
tensor is an argument (see mesp.ondevice.programs); the embedding and the loss (final norm + head
+ CE -> loss, grad of the last hidden state) likewise; run_config.json ties it together. Blocks of
one structure (same layer type, shapes, storage) share one set of programs: Qwen2.5-0.5B's 24 blocks
need 3 programs, not 72.

Fixed at export: batch size and sequence length (the runner pads shorter rows; the loss program
alone takes a dynamic number of trained rows, at most batch × seq). Not exported: MeSP's "store h"
ablation (h = x Aᵀ is always recomputed) and gradient accumulation.

ExecuTorch (`--target executorch`, or `--pte`; needs the `executorch` package, not a dependency:
1.5.1 installs beside torch 2.13.0 without replacing it): every program of a step is also lowered
to a .pte, with the edge formulations (core-ATen 4-bit unpack, query-tiled attention) and the
XNNPACK delegate, for the native runner (runtime/) and the Python driver (mesp.ondevice.et_driver).
See mesp.ondevice.export_et.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from mesp.errors import MespError
from mesp.lora import PEFT_PREFIX
from mesp.models.transformer import CausalLM
from mesp.ondevice.edge_programs import EdgeSpec, Embed, LossAndGrad
from mesp.ondevice.programs import (
    BlockBackward,
    BlockForward,
    BlockSpec,
    WeightSpec,
    block_forward,
    block_parts,
    frozen_tensors,
)
from mesp.ops.attention import _cpu_flash, additive_mask

log = logging.getLogger("mesp")
FORMAT = "mesp-artifacts"
VERSION = 1
ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


@dataclass
class ExportOptions:
    seq_len: int = field(default=256, metadata={"help": "sequence length fixed in the programs"})
    batch_size: int = field(default=1, metadata={"help": "sequences per step, fixed"})
    vocab_chunk: int = field(
        default=8192, metadata={"help": "loss: head slice rows (the engine's default)"}
    )
    target: str = field(
        default="torch",
        metadata={
            "help": "torch: .pt2 programs for the torch runner; executorch: .pte programs for "
            "the native runner and the ExecuTorch driver",
            "choices": ("torch", "executorch"),
        },
    )
    pte: bool = field(default=False, metadata={"help": "same as --target executorch"})
    attn_tile: int = field(
        default=64,
        metadata={"help": "ExecuTorch attention: query rows per tile (scores are tile × seq)"},
    )
    portable: bool = field(
        default=False, metadata={"help": "ExecuTorch: portable kernels only, no XNNPACK delegate"}
    )

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "vocab_chunk", "attn_tile"):
            if getattr(self, name) < 1:
                raise MespError(f"--{name.replace('_', '-')} must be positive")
        if self.seq_len < 2:
            raise MespError("--seq-len must be at least 2")
        if self.target not in ("torch", "executorch"):
            raise MespError(f"--target must be torch or executorch, got {self.target!r}")
        if self.pte:
            self.target = "executorch"

    @property
    def executorch(self) -> bool:
        return self.target == "executorch"


def _table(tensors: dict[str, Tensor]) -> dict[str, Any]:
    return {k: {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape)} for k, t in tensors.items()}


def _digest(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().reshape(-1)
        h.update(k.encode())
        h.update(ST_DTYPES[t.dtype].encode() + str(list(tensors[k].shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _ws(module: Any, prefix: str) -> WeightSpec:
    return WeightSpec(prefix, module.quant)


class _Writer:
    """Files go to a temporary sibling of out_dir, renamed into place once all are written."""

    def __init__(self, out_dir: Path) -> None:
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise MespError(
                f"{out_dir}: exists and is not an empty directory; choose another --out"
            )
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
        except OSError as e:
            raise MespError(f"{out_dir}: cannot create ({e.strerror or e})") from None
        self.out = out_dir

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def commit(self) -> None:
        if self.out.exists():
            self.out.rmdir()  # empty, checked above
        self.tmp.rename(self.out)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _ctx(model: CausalLM, seq_len: int) -> dict[str, dict[str, Tensor]]:
    """Per layer type: RoPE tables and, for sliding layers shorter than S, the additive mask."""
    c = model.context(seq_len, torch.device("cpu"))
    out = {}
    for t in sorted(c.cos):
        d = {"cos": c.cos[t].contiguous(), "sin": c.sin[t].contiguous()}
        if c.mask[t] is not None:
            d["mask"] = additive_mask(c.mask[t], model.dtype)
        out[t] = d
    return out


def _check_model(model: CausalLM) -> tuple[int, float, list[str]]:
    mods = model.lora_modules()
    if not mods:
        raise MespError("the model has no LoRA adapters to export")
    ranks = {m.rank for m in mods.values()}
    scales = {m.lora_scale for m in mods.values()}
    if len(ranks) != 1 or len(scales) != 1:
        raise MespError("every adapter must share one rank and scale (PEFT's r and lora_alpha)")
    targets = sorted({n.rsplit(".", 1)[-1] for n in mods})
    return ranks.pop(), scales.pop(), targets


def _export(module: torch.nn.Module, args: tuple, dynamic: Any = None) -> Any:
    try:
        return torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # torch.export raises many types; keep the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MespError(f"torch.export failed for {type(module).__name__}: {first}") from e


def _blocks(model: CausalLM, ctx: dict[str, dict[str, Tensor]]) -> tuple[dict, list, dict]:
    """Per block: its weights file and table; blocks of identical structure share programs.
    -> (structure -> (program id, first block), block rows for the config, files)."""
    groups: dict[Any, tuple[str, int]] = {}
    rows, files = [], {}
    for i, block in enumerate(model.layers):
        w, lora = block_parts(block)
        bs = BlockSpec.of(model, block, "mask" in ctx[block.layer_type])
        key = (bs, block.layer_type, repr(_table(w)), repr(_table(lora)))
        gid = groups.setdefault(key, (f"g{len(groups)}", i))[0]
        rel = f"blocks/block_{i:03d}.safetensors"
        files[rel] = w
        row = {"file": rel, "fn": gid, "layer_type": block.layer_type}
        rows.append({**row, "tensors": _table(w), "lora": _table(lora)})
    return groups, rows, files


def _edges(model: CausalLM, vocab_chunk: int) -> tuple[EdgeSpec, dict, dict]:
    """The embedding's and the head's spec and frozen tensors (tied: the head is the embedding;
    head.safetensors then holds only the final norm)."""
    cfg = model.config
    embed_w = frozen_tensors(model.model.embed_tokens, "embed_tokens.")
    head_w = {"norm.weight": model.model.norm.weight.contiguous()}
    head_prefix = "embed_tokens"
    if model.lm_head is not None:
        head_w.update(frozen_tensors(model.lm_head, "lm_head."))
        head_prefix = "lm_head"
    es = EdgeSpec(
        embed=_ws(model.model.embed_tokens, "embed_tokens"),
        head=_ws(model.head_weight(), head_prefix),
        dtype=model.dtype,
        embed_scale=cfg.hidden_size**0.5 if model.spec.embed_scale else None,
        eps=cfg.rms_norm_eps,
        norm_offset=model.spec.norm_offset,
        softcap=cfg.final_logit_softcapping,
        vocab_chunk=vocab_chunk if vocab_chunk < cfg.vocab_size else None,  # as MeSPEngine
        vocab=cfg.vocab_size,
    )
    return es, embed_w, head_w


def export_model(
    model: CausalLM, out_dir: Path, opts: ExportOptions, base_name: str = ""
) -> dict[str, Any]:
    """Write the artifact directory for `model` (with its adapters attached); returns the config."""
    rank, scale, targets = _check_model(model)
    cfg, S, B = model.config, opts.seq_len, opts.batch_size
    if S > cfg.max_position_embeddings:
        raise MespError(f"--seq-len {S} is over the model's {cfg.max_position_embeddings}")
    _cpu_flash()  # probe the attention kernel eagerly, never inside a trace
    ctx = _ctx(model, S)
    groups, block_rows, files = _blocks(model, ctx)
    es, embed_w, head_w = _edges(model, opts.vocab_chunk)
    if opts.executorch:  # packed words as bytes, the form the edge programs read
        from mesp.ondevice.export_et import edge_weights

        files = {rel: edge_weights(t) for rel, t in files.items()}
        for row in block_rows:
            row["tensors"] = _table(files[row["file"]])
        embed_w, head_w = edge_weights(embed_w), edge_weights(head_w)
    lora_init = {
        f"{PEFT_PREFIX}model.layers.{i}.{n}.weight": p.detach().contiguous()
        for i, block in enumerate(model.layers)
        for n, p in block.named_parameters()
    }
    files["embedding.safetensors"], files["head.safetensors"] = embed_w, head_w
    files["context.safetensors"] = {f"{t}.{k}": v for t, d in ctx.items() for k, v in d.items()}
    files["lora_init.safetensors"] = lora_init
    spec = model.spec
    conf: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model": {
            "family": cfg.family,
            "base_model": base_name,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "layer_types": list(cfg.layer_types),
            "sliding_window": cfg.sliding_window,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "qk_norm": spec.qk_norm,
            "sandwich_norms": spec.sandwich_norms,
            "embed_scale": spec.embed_scale,
            "activation": spec.activation,
            "final_logit_softcapping": cfg.final_logit_softcapping,
        },
        "dtype": str(model.dtype).removeprefix("torch."),
        "seq_len": S,
        "batch_size": B,
        "quant": _quant_of(model),
        "lora": {
            "rank": rank,
            "scale": scale,
            "alpha": scale * rank,
            "targets": targets,
            "dtype": str(next(iter(lora_init.values())).dtype).removeprefix("torch."),
            "init": "lora_init.safetensors",
        },
        "loss": {"vocab_chunk": es.vocab_chunk, "max_rows": B * S, "normalizer": "trained tokens"},
        "files": {rel: {"tensors": _table(t), "sha256": _digest(t)} for rel, t in files.items()},
        "blocks": block_rows,  # in model order: the forward walks them 0..L-1, backward L-1..0
        "context": "context.safetensors holds '{layer_type}.cos|sin|mask' for each layer type",
    }
    conf["export_id"] = hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()[:32]
    eid = conf["export_id"]

    writer = _Writer(out_dir)
    try:
        for rel, t in files.items():
            save_file(t, str(writer.path(rel)), metadata={"export_id": eid})
        if opts.executorch:
            from mesp.ondevice.export_et import export_executorch

            conf["executorch"] = export_executorch(
                model,
                groups,
                ctx,
                es,
                embed_w,
                head_w,
                S,
                B,
                opts.attn_tile,
                writer,
                delegate=not opts.portable,
            )
        else:
            conf["functions"] = _export_functions(
                model, groups, ctx, es, embed_w, head_w, opts, writer, eid
            )
        writer.path("run_config.json").write_text(json.dumps(conf, indent=1) + "\n")
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return conf


def _quant_of(model: CausalLM) -> dict[str, int] | None:
    specs = {m.quant for m in model.modules() if getattr(m, "quant", None) is not None}
    if not specs:
        return None
    q = sorted(specs, key=lambda s: (s.bits, s.group_size))[0]
    return {"bits": q.bits, "group_size": q.group_size}


def _check_no_constants(ep: Any, rel: str) -> None:
    """Every tensor of a program must be an argument: a lifted constant or a parameter/buffer
    would be a weight copy stored inside the .pt2 (and loaded beside the safetensors one)."""
    baked = [*ep.state_dict, *ep.constants]
    if baked:
        raise MespError(f"{rel}: the program captured tensors as constants: {sorted(baked)[:3]}")


def _save_program(ep: Any, rel: str, writer: _Writer, eid: str) -> dict[str, Any]:
    """The .pt2 holds the graph (JSON) and no tensor: the example inputs torch.export keeps
    (they include the frozen weights it was traced with) would be saved as a torch.save pickle,
    data/sample_inputs/model.pt, and loaded back with torch.load; they are dropped first."""
    _check_no_constants(ep, rel)
    ep.example_inputs = None
    torch.export.save(ep, str(writer.path(rel)), extra_files={"export_id": eid})
    return {"pt2": rel}


def _export_functions(
    model: CausalLM,
    groups: dict[Any, tuple[str, int]],
    ctx: dict[str, dict[str, Tensor]],
    es: EdgeSpec,
    embed_w: dict[str, Tensor],
    head_w: dict[str, Tensor],
    opts: ExportOptions,
    writer: _Writer,
    eid: str,
) -> dict[str, Any]:
    S, B, hid = opts.seq_len, opts.batch_size, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(B, S, hid, generator=g) * 0.5).to(model.dtype)
    fns: dict[str, Any] = {"blocks": {}}
    for (bs, ltype, *_), (gid, i) in groups.items():
        w, lora = block_parts(model.layers[i])
        c = ctx[ltype]
        with torch.no_grad():
            tape: dict[str, Tensor] = {}
            block_forward(bs, w, lora, x, c, tape)
            saved = dict(sorted(tape.items()))
        names = {"weights": list(w), "lora": list(lora), "ctx": list(c), "saved": list(saved)}
        fwd = _export(BlockForward(bs, saved=False), (w, lora, x, c))
        rec = _export(BlockForward(bs, saved=True), (w, lora, x, c))
        bwd = _export(BlockBackward(bs), (saved, x.clone(), x, w, lora, c))
        progs = {"forward": fwd, "recompute": rec, "backward": bwd}
        fns["blocks"][gid] = {
            "layer_type": ltype,
            "inputs": names,
            **{k: _save_program(p, f"fns/{gid}_{k}.pt2", writer, eid) for k, p in progs.items()},
        }
    ids = torch.zeros(B, S, dtype=torch.long)
    ep = _export(Embed(es), (embed_w, ids))
    fns["embed"] = _save_program(ep, "fns/embed.pt2", writer, eid)
    fns["embed"]["inputs"] = {"weights": list(embed_w)}
    n = min(B * S, 3)  # trained rows vary per batch: a dynamic dimension, 1 ≤ n ≤ B·S
    rows = torch.arange(n)
    tgt = torch.zeros(n, dtype=torch.long)
    norm = torch.tensor(float(n), dtype=torch.float32)
    dim = torch.export.Dim("rows", min=1, max=B * S)
    loss_w = head_w if es.head.prefix == "lm_head" else {**head_w, **embed_w}  # tied: the embedding
    dyn = ({k: None for k in loss_w}, None, {0: dim}, {0: dim}, None)
    ep = _export(LossAndGrad(es), (loss_w, x, rows, tgt, norm), dyn)
    fns["loss"] = _save_program(ep, "fns/loss.pt2", writer, eid)
    fns["loss"]["inputs"] = {"weights": list(loss_w)}
    return fns


__all__ = ["ExportOptions", "export_model"]
