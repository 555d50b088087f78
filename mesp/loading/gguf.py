"""Read a llama.cpp GGUF file into an HF-shaped config, HF-named float32 tensors and a tokenizer.

We parse the header ourselves instead of using `gguf.GGUFReader`: the reader builds a numpy view
per array element, which takes ~25 s for Gemma 3's 262k-token vocabulary, and it reports
truncation as assorted numpy errors. Dequantization is left to `gguf.quants.dequantize`.

llama.cpp's converter changes some tensors on the way in; `gguf_hf.undo_converter` reverses
that, so the result equals what `transformers` loads from the same file (checked in
tests/test_real_gguf.py). The name maps and the HF config built from the metadata are in gguf_hf.py.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quant_shape_to_byte_shape
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from mesp.errors import MespError
from mesp.loading.gguf_codes import STORED, to_mlx
from mesp.loading.gguf_hf import (
    ARCHS,
    GEMMA_LAYER,
    GLOBAL,
    LAYER,
    REQUIRED,
    hf_config,
    llama3_rope_scaling,
    shown,
    undo_converter,
)
from mesp.loading.gguf_tokenizer import tokenizer_from_gguf
from mesp.loading.tokenizer import Tokenizer

# Q5_0/Q5_1 are here because llama.cpp's Q4_K_M mixes use them (Gemma 3 270M has 81 Q5_0 tensors).
SUPPORTED_TYPES = {
    QT.F32,
    QT.F16,
    QT.BF16,
    QT.Q8_0,
    QT.Q4_0,
    QT.Q4_1,
    QT.Q5_0,
    QT.Q5_1,
    QT.Q4_K,
    QT.Q5_K,
    QT.Q6_K,
}
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


class _Info(NamedTuple):
    qtype: QT
    shape: tuple[int, ...]  # numpy order (ggml's dims reversed), i.e. HF's [out, in]
    start: int  # absolute byte offset in the file
    nbytes: int


class _Header:
    """Sequential little-endian reader over the mapped file; running off the end = truncation."""

    def __init__(self, buf: mmap.mmap, where: str) -> None:
        self.buf, self.pos, self.where = buf, 0, where

    def take(self, n: int) -> int:
        if self.pos + n > len(self.buf):
            raise MespError(
                f"{self.where}: truncated GGUF file (header runs past the end, "
                f"byte {len(self.buf)})"
            )
        self.pos += n
        return self.pos - n

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            if depth >= 4:  # real files nest one level (arrays of strings or numbers)
                raise MespError(f"{self.where}: corrupt GGUF file (arrays nested too deeply)")
            sub, n = self.scalar(4), self.scalar(10)
            if sub in _SCALAR:  # numeric arrays (scores, token types) in one numpy read
                dt = np.dtype(_SCALAR[sub])
                return np.frombuffer(self.buf, dt, n, self.take(n * dt.itemsize)).tolist()
            return [self.value(sub, depth + 1) for _ in range(n)]
        if vtype not in _SCALAR:
            raise MespError(f"{self.where}: corrupt GGUF file (unknown metadata type {vtype})")
        return self.scalar(vtype)


def _parse(
    buf: mmap.mmap, where: str, kinds: dict[str, tuple[int, int | None]] | None = None
) -> tuple[dict[str, Any], dict[str, _Info]]:
    """(metadata, tensor infos); `kinds`, when given, gets each key's value type (and an array's
    element type), so a writer can copy keys exactly (mesp.convert.gguf_model)."""
    h = _Header(buf, where)
    if len(buf) < 4 or buf[:4] != b"GGUF":
        raise MespError(f"{where}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    h.take(4)
    version = h.scalar(4)
    if version & 0xFFFF == 0:
        raise MespError(f"{where}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise MespError(f"{where}: unsupported GGUF version {version} (need 2 or 3)")
    n_tensors, n_kv = h.scalar(10), h.scalar(10)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, vtype = h.string(), h.scalar(4)
        if kinds is not None:
            arr = vtype == 9 and h.pos + 4 <= len(buf)  # a cut file fails in h.value
            sub = struct.unpack_from("<I", buf, h.pos)[0] if arr else None
            kinds[key] = (vtype, sub)
        meta[key] = h.value(vtype)
    raw = []
    for _ in range(n_tensors):
        name, ndim = h.string(), h.scalar(4)
        if ndim > 4:
            raise MespError(f"{where}: corrupt GGUF file (tensor {shown(name)} has {ndim} dims)")
        dims = [h.scalar(10) for _ in range(ndim)]
        raw.append((name, dims, h.scalar(4), h.scalar(10)))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise MespError(f"{where}: corrupt GGUF file (general.alignment = {align!r})")
    data_start = (h.pos + align - 1) // align * align
    infos: dict[str, _Info] = {}
    for name, dims, type_id, offset in raw:
        try:
            qtype = QT(type_id)
        except ValueError:
            raise MespError(
                f"{where}: tensor {shown(name)} has unknown ggml type id {type_id}"
            ) from None
        if qtype not in SUPPORTED_TYPES:
            raise MespError(
                f"{where}: tensor {shown(name)} has unsupported quant type {qtype.name} "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
            )
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not dims or dims[0] % block:
            raise MespError(f"{where}: corrupt GGUF file (tensor {shown(name)} dims {dims})")
        nbytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise MespError(
                f"{where}: truncated GGUF file (tensor {shown(name)} ends at byte "
                f"{start + nbytes}, file has {len(buf)})"
            )
        infos[name] = _Info(qtype, tuple(reversed(dims)), start, nbytes)
    return meta, infos


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
        meta, infos = _parse(buf, where)
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
        layer_map = GEMMA_LAYER if arch == "gemma3" else LAYER
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
            elif name != "rope_freqs.weight" or arch != "llama":
                raise MespError(f"{where}: unexpected tensor {shown(name)} for architecture {arch}")
        self._infos, self._arch, self.config = infos, arch, cfg
        if "rope_freqs.weight" in infos:  # Llama 3 rope scaling, folded into the config
            freqs = self._values("rope_freqs.weight").astype(np.float64)
            cfg["rope_scaling"] = llama3_rope_scaling(freqs, cfg, where)

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
        meta, _ = _parse(g._buf, g.where, kinds)
    return {k: (v, *kinds[k]) for k, v in meta.items()}


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer]:
    """Return (hf_config, float32 HF-named tensors, tokenizer): every tensor at once (tests,
    tools); `load_model` goes through GGUFFile and reads one tensor at a time instead."""
    with GGUFFile(path) as g:
        return g.config, {n: g.tensor(n) for n in g.names}, g.tokenizer
