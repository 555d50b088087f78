"""`mesp export-adapter`: a PEFT adapter as a llama.cpp LoRA GGUF, in the form llama.cpp's own
convert_lora_to_gguf.py writes, so `llama-cli -m base.gguf --lora adapter.gguf` applies it:

- metadata: `general.architecture` (the base's), `general.type = adapter`,
  `adapter.type = lora`, `adapter.lora.alpha` (float32; llama.cpp scales by alpha / rank);
- per adapted linear, `<base GGUF tensor name>.lora_a` = PEFT's lora_A, numpy (r, in), and
  `.lora_b` = lora_B, numpy (out, r), which llama.cpp checks against the base tensor's ne;
- the converter runs A and B through the base model's tensor edits, where only llama's q/k
  row permutation touches a linear: it permutes B's rows (the output rows) and leaves A;
- no hyperparameters, no tokenizer, no rope_freqs (the converter writes none for adapters);
- F32 by default, as the converter's --outtype; f16 on request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType as FT

from mesp.atomic_io import atomic_write
from mesp.config import ModelConfig
from mesp.convert.gguf_model import ARCHS, PERMUTED, gguf_names, permute_rows
from mesp.errors import MespError
from mesp.loading.hub import adapter_dir
from mesp.loading.session import ModelOptions, open_model
from mesp.lora import check_output_dir, load_adapter
from mesp.models.transformer import CausalLM

ADAPTER_TYPES = {"f32": (QT.F32, FT.ALL_F32), "f16": (QT.F16, FT.MOSTLY_F16)}


@dataclass
class ExportAdapterOptions:
    adapter: str = field(default="", metadata={"help": "PEFT adapter directory", "required": True})
    out: str = field(
        default="",
        metadata={"help": "the llama.cpp LoRA file to write (FILE.gguf)", "required": True},
    )
    gguf_type: str = field(
        default="f32",
        metadata={"help": "tensor type of lora_a / lora_b", "choices": tuple(ADAPTER_TYPES)},
    )


def gguf_targets(cfg: ModelConfig, names: list[str]) -> list[tuple[str, str, int]]:
    """Per adapted linear (module names, in the file's tensor order): its base GGUF tensor name
    and the head count its B rows are permuted by (0: none). Shared with `mesp export`, which
    records it so that the on-device drivers write the same file without model code."""
    gnames = gguf_names(cfg, [f"{n}.weight" for n in names])
    out = []
    for name in names:
        base, heads = gnames[f"{name}.weight"], 0
        if cfg.family in PERMUTED and base.endswith("attn_q.weight"):
            heads = cfg.num_attention_heads
        elif cfg.family in PERMUTED and base.endswith("attn_k.weight"):
            heads = cfg.num_key_value_heads
        out.append((name, base, heads))
    return out


def adapter_section(model: CausalLM, alpha: float) -> dict[str, Any] | None:
    """run_config.json's "gguf_adapter" (mesp.ondevice.contract.GGUF_ADAPTER): what a driver
    needs to write the trained adapter as this file's llama.cpp LoRA GGUF; None for a family
    with no llama.cpp form here (the drivers then write the PEFT directory alone)."""
    cfg = model.config
    if cfg.family not in ARCHS:
        return None
    try:
        targets = gguf_targets(cfg, list(model.lora_modules()))
    except MespError:  # a linear with no llama.cpp name
        return None
    tensors = []
    for name, base, heads in targets:
        layer, dot, module = name.removeprefix("model.layers.").partition(".")
        if not (dot and layer.isdigit()):  # only block linears are trained on device
            return None
        tensors.append({"layer": int(layer), "module": module, "name": base, "permute": heads})
    arch = gguf.MODEL_ARCH_NAMES[ARCHS[cfg.family]]
    return {"architecture": arch, "alpha": alpha, "tensors": tensors}


def export_adapter(opts: ModelOptions, e: ExportAdapterOptions) -> str:
    """Check the adapter against its base (shapes, targets), write the LoRA GGUF, and return
    the line that says what was written."""
    out = Path(e.out)
    if out.suffix != ".gguf":
        raise MespError(f"--out {out}: a llama.cpp adapter is a file ending in .gguf")
    if out.is_dir():
        raise MespError(f"{out}: is a directory; give a file name ending in .gguf")
    if e.gguf_type not in ADAPTER_TYPES:
        raise MespError(f"--gguf-type {e.gguf_type!r}: choose from {', '.join(ADAPTER_TYPES)}")
    qtype, ftype = ADAPTER_TYPES[e.gguf_type]
    check_output_dir(out.parent)
    loaded = open_model(opts)  # the base only names and shapes the tensors; any precision does
    cfg = loaded.model.config
    if cfg.family not in ARCHS:  # no writer yet
        raise MespError(
            f"{loaded.source}: a llama.cpp adapter for {cfg.family} is not supported yet "
            f"(supported: {', '.join(ARCHS)}); the PEFT adapter directory works with PEFT"
        )
    lcfg = load_adapter(loaded.model, adapter_dir(e.adapter))
    mods = loaded.model.lora_modules()
    tensors = {}
    for name, base, heads in gguf_targets(cfg, list(mods)):
        a = mods[name].lora_A.detach().float().cpu().numpy()
        b = mods[name].lora_B.detach().float().cpu().numpy()
        tensors[f"{base}.lora_a"] = a
        tensors[f"{base}.lora_b"] = permute_rows(b, heads) if heads else b

    def write(path: str) -> None:
        w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCHS[cfg.family]])
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lcfg.lora_alpha)
        w.add_name(Path(e.adapter).name)
        w.add_file_type(ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for tname, data in tensors.items():
            w.add_tensor(tname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(out, write)
    return (
        f"mesp: wrote rank-{lcfg.rank} LoRA adapter {e.adapter} ({len(mods)} linears, "
        f"alpha {lcfg.lora_alpha:g}, {e.gguf_type}) for {loaded.source} to {out}"
    )
