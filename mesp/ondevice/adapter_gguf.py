"""The trained adapter as llama.cpp's LoRA GGUF, from run_config.json's "gguf_adapter" section
(mesp.ondevice.contract): byte for byte what `mesp export-adapter --adapter OUT` writes from the
PEFT directory beside it, and what the native runner writes (runtime/src/adapter.cpp). No model
code: the export recorded each linear's base tensor name and its B-row permutation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import torch

from mesp.ondevice.contract import GGUF_ADAPTER


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved (the twin of
    mesp.convert.gguf_model.permute_rows, which the driver cannot import)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def adapter_gguf_writer(
    conf: dict[str, Any], lora: list[dict[str, torch.Tensor]], out: Path
) -> tuple[Callable[[str], None] | None, str]:
    """(write(path), "") for the adapter in `lora` (per block, PEFT keys such as
    "self_attn.q_proj.lora_A"), or (None, the one line saying why there is no file). `out` is
    the adapter directory: its name is the file's general.name, as export-adapter names it."""
    sec = conf.get(GGUF_ADAPTER)
    if not isinstance(sec, dict):
        why = "is none" if GGUF_ADAPTER in conf else "was not recorded (export again)"
        family = conf.get("model", {}).get("family", "?")
        return None, f"no adapter.gguf: the llama.cpp form of this {family} adapter {why}"
    tensors: dict[str, Any] = {}  # name -> float32 numpy array
    for t in sec["tensors"]:
        d = lora[int(t["layer"])]
        a, b = d[f"{t['module']}.lora_A"].detach(), d[f"{t['module']}.lora_B"].detach()
        heads = int(t["permute"])
        tensors[f"{t['name']}.lora_a"] = a.float().contiguous().numpy()
        b = permute_rows(b, heads) if heads else b
        tensors[f"{t['name']}.lora_b"] = b.float().contiguous().numpy()

    def write(path: str) -> None:  # the calls and order of mesp.convert.gguf_adapter
        w = gguf.GGUFWriter(path, str(sec["architecture"]))
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(sec["alpha"]))
        w.add_name(out.name)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, data in tensors.items():
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return write, ""


__all__ = ["adapter_gguf_writer", "permute_rows"]
