"""The GGUF header: magic, version, metadata keys and tensor infos, parsed from a memory map.

We parse it ourselves instead of using `gguf.GGUFReader`: the reader builds a numpy view per
array element, which takes ~25 s for Gemma 3's 262k-token vocabulary, and it reports
truncation as assorted numpy errors. Every malformed header is a one-line MespError
(tests/test_fuzz_headers.py).
"""

from __future__ import annotations

import math
import mmap
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from mesp.errors import MespError
from mesp.loading.gguf_hf import shown

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


class TensorInfo(NamedTuple):
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


def parse_header(
    buf: mmap.mmap, where: str, kinds: dict[str, tuple[int, int | None]] | None = None
) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
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
    infos: dict[str, TensorInfo] = {}
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
        if not dims or dims[0] % block or min(dims) <= 0:
            raise MespError(f"{where}: corrupt GGUF file (tensor {shown(name)} dims {dims})")
        if offset % align:  # GGUF aligns every tensor's data; a value read must not straddle
            raise MespError(
                f"{where}: corrupt GGUF file (tensor {shown(name)} at offset {offset}, not a "
                f"multiple of the alignment {align})"
            )
        nbytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise MespError(
                f"{where}: truncated GGUF file (tensor {shown(name)} ends at byte "
                f"{start + nbytes}, file has {len(buf)})"
            )
        infos[name] = TensorInfo(qtype, tuple(reversed(dims)), start, nbytes)
    return meta, infos
