"""Read a llama.cpp GGUF file into an HF-shaped config, HF-named tensors and a tokenizer.

The header is parsed in gguf_header.py. Dequantization is left to `gguf.quants.dequantize`;
`packed` keeps a quantized weight's codes as stored instead (gguf_codes.py).

llama.cpp's converter changes some tensors on the way in; `gguf_hf.undo_converter` reverses
that, so the result equals what `transformers` loads from the same file (checked in
tests/test_real_gguf.py). The name maps and the HF config built from the metadata are in gguf_hf.py.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quant_shape_to_byte_shape
from gguf.quants import dequantize

from mesp.errors import MespError
from mesp.loading.gguf_codes import STORED, to_mlx
from mesp.loading.gguf_header import parse_header
from mesp.loading.gguf_hf import (
    ARCHS,
    GEMMA_LAYER,
    GLOBAL,
    LAYER,
    OLMO_LAYER,
    PHI3_LAYER,
    REQUIRED,
    ROPE_FACTORS,
    hf_config,
    llama3_rope_scaling,
    phi3_rope_scaling,
    shown,
    undo_converter,
)
from mesp.loading.gguf_tokenizer import tokenizer_from_gguf
from mesp.loading.tokenizer import Tokenizer

# tensors beyond the blocks' and GLOBAL's that an architecture's file may hold, folded into the
# config: Llama 3's rope_freqs, Phi-3's LongRoPE factor sets
EXTRA = {("rope_freqs.weight", "llama"), ("rope_freqs.weight", "smollm3")} | {
    (n, "phi3") for n in ROPE_FACTORS
}


class GGUFFile:
    """An open llama.cpp GGUF file: the HF config and tokenizer are parsed at open; each tensor
    is dequantized from the memory map only when `tensor(name)` asks for it, so loading peaks at
    one float32 tensor on top of the model being built (not the whole model in float32)."""

    def __init__(self, path: Path) -> None:
        self.where = where = str(path)
        try:
            with open(path, "rb") as f:
                if Path(path).stat().st_size == 0:  # mmap cannot map an empty file
                    raise MespError(f"{where}: not a GGUF file (empty)")
                self._buf: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise MespError(f"{where}: cannot open: {e.strerror}") from None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        where, buf = self.where, self._buf
        assert buf is not None
        meta, infos = parse_header(buf, where)
        arch = meta.get("general.architecture")
        if arch not in ARCHS:
            raise MespError(
                f"{where}: general.architecture = {arch!r} is not supported ({', '.join(ARCHS)})"
            )
        try:
            cfg = hf_config(meta, infos, arch, where)
        except (TypeError, ValueError) as e:  # a key holding the wrong kind of value
            raise MespError(f"{where}: bad metadata value: {e}") from None
        self.tokenizer = tokenizer_from_gguf(meta, where)
        maps = {
            "gemma3": GEMMA_LAYER,
            "gemma2": GEMMA_LAYER,
            "olmo2": OLMO_LAYER,
            "phi3": PHI3_LAYER,
        }
        layer_map = maps.get(arch, LAYER)
        n_layers = cfg["num_hidden_layers"]
        wanted = [f"blk.{i}.{t}.weight" for i in range(n_layers) for t in REQUIRED[arch]]
        wanted += [
            f"blk.{i}.attn_{x}.bias" for i in range(n_layers) for x in "qkv" if arch == "qwen2"
        ] + ["output_norm.weight"]
        if missing := [n for n in wanted if n not in infos]:
            raise MespError(f"{where}: missing tensor '{missing[0]}' ({len(missing)} missing)")
        self._by_hf: dict[str, str] = {}  # HF name -> GGUF name, checked before any dequantizing
        for name in infos:
            blk, layer, leaf = (name.split(".", 2) + ["", ""])[:3]
            if name in GLOBAL:
                self._by_hf[GLOBAL[name]] = name
            elif blk == "blk" and layer.isdigit() and int(layer) < n_layers and leaf in layer_map:
                self._by_hf[f"model.layers.{layer}.{layer_map[leaf]}"] = name
            elif (name, arch) not in EXTRA:
                raise MespError(f"{where}: unexpected tensor {shown(name)} for architecture {arch}")
        self._infos, self._arch, self.config = infos, arch, cfg
        if "rope_freqs.weight" in infos:  # Llama 3 rope scaling, folded into the config
            freqs = self._values("rope_freqs.weight").astype(np.float64)
            cfg["rope_scaling"] = llama3_rope_scaling(freqs, cfg, where)
        if arch == "phi3" and all(n in infos for n in ROPE_FACTORS):  # LongRoPE
            long, short = (self._values(n).astype(np.float64) for n in ROPE_FACTORS)
            cfg["rope_scaling"] = phi3_rope_scaling(long, short, cfg, where)

    def _values(self, name: str) -> np.ndarray:
        if self._buf is None:
            raise MespError(f"{self.where}: read after close")
        info = self._infos[name]
        raw = np.frombuffer(self._buf, np.uint8, info.nbytes, info.start)
        values = dequantize(
            raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype)), info.qtype
        )
        if np.may_share_memory(values, raw):  # F32 dequantizes to a view of the map
            values = values.copy()
        return values

    @property
    def names(self) -> list[str]:
        """HF names of the tensors this file holds."""
        return list(self._by_hf)

    def tensor(self, hf_name: str) -> torch.Tensor:
        """One float32 tensor under its HF name, with llama.cpp's converter edits undone."""
        name = self._by_hf[hf_name]
        values = undo_converter(name, self._values(name), self._arch, self.config, self.where)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def qtype(self, hf_name: str) -> QT:
        """The ggml type a tensor is stored in."""
        return self._infos[self._by_hf[hf_name]].qtype

    @property
    def quantized(self) -> bool:
        """Whether any weight matrix holds llama.cpp codes that `packed` keeps as stored."""
        return any(self.qtype(n) in STORED and n.endswith(".weight") for n in self._by_hf)

    def packed(self, hf_name: str) -> tuple[torch.Tensor, ...] | None:
        """A weight matrix's codes as stored, in MLX's layout: (words, scales, biases) + spec,
        scales and biases float32 (gguf_codes says why this is exact); None for a float tensor."""
        if self._buf is None:
            raise MespError(f"{self.where}: read after close")
        name = self._by_hf[hf_name]
        info = self._infos[name]
        if info.qtype not in STORED or len(info.shape) != 2 or name.endswith("norm.weight"):
            return None
        raw = np.frombuffer(self._buf, np.uint8, info.nbytes, info.start)
        arrays = to_mlx(info.qtype, raw, (info.shape[0], info.shape[1]))
        # the converter's only edit of a matrix is llama's q/k row order: rows move whole
        w, s, b = (
            torch.from_numpy(np.ascontiguousarray(undo_converter(name, a, self._arch, self.config,
                                                                 self.where)))
            for a in arrays
        )  # fmt: skip
        return w, s, b, STORED[info.qtype][0]

    def close(self) -> None:
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:  # a numpy view is still alive somewhere; the GC will unmap it
                pass
            self._buf = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metadata(path: Path) -> dict[str, tuple[Any, int, int | None]]:
    """Every metadata key of a GGUF file as (value, GGUF value type, array element type or
    None), tensors left unread."""
    kinds: dict[str, tuple[int, int | None]] = {}
    with GGUFFile(path) as g:
        assert g._buf is not None
        meta, _ = parse_header(g._buf, g.where, kinds)
    return {k: (v, *kinds[k]) for k, v in meta.items()}


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer]:
    """Return (hf_config, float32 HF-named tensors, tokenizer): every tensor at once (tests,
    tools); `load_model` goes through GGUFFile and reads one tensor at a time instead."""
    with GGUFFile(path) as g:
        return g.config, {n: g.tensor(n) for n in g.names}, g.tokenizer
