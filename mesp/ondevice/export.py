"""`mesp export`: per-block artifacts and the ExecuTorch programs that train from them.

The split follows the original MeSP (Python exports, a Swift runner trains): frozen weights as one
safetensors file per block, read only while that block runs; every program of a step (embedding,
each block's forward and recompute + hand backward, the loss as start / vocabulary slice / finish,
the SGD and AdamW updates) lowered to an ExecuTorch .pte whose every tensor is an input (see
mesp.ondevice.export_et); run_config.json ties it together. The files and their atomic writer are
artifact_files.py. Blocks of one structure (same layer type, shapes, storage) share one set of
programs: Qwen2.5-0.5B's 24 blocks need one forward and one backward, not 48.

One on-device format: the native runner (runtime/, C++, no Python, no libtorch) and the Python
driver (mesp.ondevice.et_driver, through executorch.runtime) run the same .pte files. Needs the
`executorch` package (the `ondevice` extra: 1.5.1 installs beside torch 2.13.0 without replacing
it) and float32 weights.

Fixed at export: batch size and sequence length (the runners pad shorter rows; the loss programs
take a dynamic number of trained rows, at most batch × seq). Not exported: MeSP's "store h"
ablation (h = x Aᵀ is always recomputed) and gradient accumulation.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from mesp.convert.gguf_adapter import adapter_section
from mesp.errors import MespError
from mesp.lora import PEFT_PREFIX
from mesp.models.transformer import CausalLM
from mesp.ondevice.artifact_files import Writer, digest, table
from mesp.ondevice.contract import FORMAT, GGUF_ADAPTER, VERSION
from mesp.ondevice.edge_programs import EdgeSpec
from mesp.ondevice.export_et import edge_weights, export_executorch
from mesp.ondevice.lower import require_executorch
from mesp.ondevice.programs import BlockSpec, WeightSpec, block_parts, frozen_tensors
from mesp.ops.attention import _cpu_flash, additive_mask

log = logging.getLogger("mesp")


@dataclass
class ExportOptions:
    seq_len: int = field(default=256, metadata={"help": "sequence length fixed in the programs"})
    batch_size: int = field(default=1, metadata={"help": "sequences per step, fixed"})
    vocab_chunk: int = field(
        default=8192, metadata={"help": "loss: head slice rows (the engine's default)"}
    )
    target: str = field(
        default="executorch",
        metadata={
            "help": "executorch (the one format): .pte programs for the native runner and the "
            "Python driver",
            "hidden": True,  # one value; kept so that --target torch gets its one-line answer
        },
    )
    attn_tile: int = field(
        default=64,
        metadata={"help": "ExecuTorch attention: query rows per tile (scores are tile × seq)"},
    )
    portable: bool = field(
        default=False,
        metadata={
            "help": "ExecuTorch: portable kernels only, no XNNPACK delegate (mesp's kernel ops "
            "still multiply the packed 4/5/6/8-bit matrices, through XNNPACK's operator API)"
        },
    )
    weight_block_kb: int = field(
        default=0,
        metadata={
            "help": "ExecuTorch: dequantize each packed block matrix in the graph, in blocks "
            "of at most KB KiB of fp32 (rows for x Wᵀ, columns for dy W) instead of with "
            "mesp's kernel ops (implies --aten-dequant; 0: the kernel ops)",
            "metavar": "KB",
        },
    )

    aten_dequant: bool = field(
        default=False,
        metadata={
            "help": "ExecuTorch: dequantize the packed block matrices with ATen ops in the "
            "graphs (any ExecuTorch runtime runs them) instead of mesp's kernel ops "
            "mesp::qlinear/qmatmul (which the native runner and mesp run-artifacts bring: "
            "a block of the matrix at a time, far less memory)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "vocab_chunk", "attn_tile"):
            if getattr(self, name) < 1:
                raise MespError(f"--{name.replace('_', '-')} must be positive")
        if self.weight_block_kb < 0:
            raise MespError("--weight-block-kb must be 0 (whole matrices) or positive")
        if self.seq_len < 2:
            raise MespError("--seq-len must be at least 2")
        if self.target == "torch":
            raise MespError(
                "--target torch is gone: the .pt2 programs and their torch runner were folded "
                "into the ExecuTorch .pte programs (the default; mesp run-artifacts runs them)"
            )
        if self.target != "executorch":
            raise MespError(f"--target must be executorch, got {self.target!r}")


def _ws(module: Any, prefix: str) -> WeightSpec:
    return WeightSpec(prefix, module.quant)


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


def _blocks(model: CausalLM, ctx: dict[str, dict[str, Tensor]]) -> tuple[dict, list, dict]:
    """Per block: its weights file and table; blocks of identical structure share programs.
    -> (structure -> (program id, first block), block rows for the config, files)."""
    groups: dict[Any, tuple[str, int]] = {}
    rows, files = [], {}
    for i, block in enumerate(model.layers):
        w, lora = block_parts(block)
        bs = BlockSpec.of(model, block, "mask" in ctx[block.layer_type])
        key = (bs, block.layer_type, repr(table(w)), repr(table(lora)))
        gid = groups.setdefault(key, (f"g{len(groups)}", i))[0]
        rel = f"blocks/block_{i:03d}.safetensors"
        files[rel] = w
        row = {"file": rel, "fn": gid, "layer_type": block.layer_type}
        rows.append({**row, "tensors": table(w), "lora": table(lora)})
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
        embed_mult=cfg.embedding_multiplier,
        logits_div=model.model.norm.divisor if model.model.norm.divisor != 1.0 else None,
    )
    return es, embed_w, head_w


def export_model(
    model: CausalLM, out_dir: Path, opts: ExportOptions, base_name: str = ""
) -> dict[str, Any]:
    """Write the artifact directory for `model` (with its adapters attached); returns the config."""
    rank, scale, targets = _check_model(model)
    require_executorch()
    if model.dtype != torch.float32:
        raise MespError("mesp export writes float32 programs: load with --dtype float32")
    cfg, S, B = model.config, opts.seq_len, opts.batch_size
    if S > cfg.max_position_embeddings:
        raise MespError(f"--seq-len {S} is over the model's {cfg.max_position_embeddings}")
    _cpu_flash()  # probe the attention kernel eagerly, never inside a trace
    ctx = _ctx(model, S)
    groups, block_rows, files = _blocks(model, ctx)
    es, embed_w, head_w = _edges(model, opts.vocab_chunk)
    files = {rel: edge_weights(t) for rel, t in files.items()}  # packed words as bytes
    for row in block_rows:
        row["tensors"] = table(files[row["file"]])
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
        # the trained adapter as llama.cpp's LoRA GGUF, written by both drivers (None: no form)
        GGUF_ADAPTER: adapter_section(model, scale * rank),
        "loss": {"vocab_chunk": es.vocab_chunk, "max_rows": B * S, "normalizer": "trained tokens"},
        "files": {rel: {"tensors": table(t), "sha256": digest(t)} for rel, t in files.items()},
        "blocks": block_rows,  # in model order: the forward walks them 0..L-1, backward L-1..0
        "context": "context.safetensors holds '{layer_type}.cos|sin|mask' for each layer type",
    }
    conf["export_id"] = hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()[:32]
    eid = conf["export_id"]

    writer = Writer(out_dir)
    try:
        for rel, t in files.items():
            save_file(t, str(writer.path(rel)), metadata={"export_id": eid})
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
            weight_block_bytes=opts.weight_block_kb << 10,
            kernel=not opts.aten_dequant,
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


__all__ = ["ExportOptions", "export_model"]
