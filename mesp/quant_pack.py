"""The packed codes of an MLX-layout weight: how they sit in memory, and every way to unpack them.

Each row of ``wq`` (rows, in·bits/32 int32 words, MLX's uint32 bit pattern) is a little-endian
bit stream: value j of the row takes bits bits·j .. bits·j + bits − 1 of the row's bytes (bit 0
of a byte its least significant). At 4 and 8 bits that is value j of a word at bits bits·j..,
the layout MLX has always had; at 5 and 6 bits (MLX's layout for those too, and how GGUF's Q5 /
Q6 codes are kept: loading/gguf_codes.py) eight values fill `bits` bytes and a value may straddle
a byte and a word boundary. Eight values are a *chunk* here: value j of a chunk starts in its byte
⌊bits·j / 8⌋ at bit bits·j mod 8, and where it runs past that byte it ends in the next one, still
inside the chunk (bits·j + bits ≤ 8·bits). A row is whole words when in·bits is a multiple of 32.

Every unpack is integer work on the bytes, so all give the same values: shifts on the eager path,
floor division by powers of two on the edge path (ExecuTorch's edge dialect refuses ``>>``), and
float ops where 4 and 8 bits allow them (what XNNPACK takes).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from mesp.errors import MespError

LITTLE_ENDIAN = sys.byteorder == "little"


def tracing() -> bool:
    """Under torch.compile / torch.export (the on-device programs)."""
    checks = (getattr(torch.compiler, f, None) for f in ("is_compiling", "is_exporting"))
    return any(f is not None and f() for f in checks)


def _starts(bits: int) -> list[tuple[int, int, bool]]:
    """Per value j of a chunk: (byte, shift, straddles into the next byte)."""
    return [(bits * j // 8, bits * j % 8, bits * j % 8 + bits > 8) for j in range(8)]


def pack(q: Tensor, bits: int) -> Tensor:
    """Values q (rows, in) in 0 .. 2^bits − 1 (any integer dtype) -> words (rows, in·bits/32)
    int32, on any host (the words are built arithmetically, not viewed)."""
    rows = q.shape[0]
    v = q.to(torch.int32).view(rows, -1, 8)  # (rows, chunks, 8)
    by = torch.zeros(rows, v.shape[1], bits, dtype=torch.int64, device=q.device)
    for j, (i, s, over) in enumerate(_starts(bits)):
        by[..., i] |= (v[..., j] << s) & 255
        if over:
            by[..., i + 1] |= v[..., j] >> (8 - s)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=q.device)
    words = (by.view(rows, -1, 4) << shifts).sum(-1)  # 4 stream bytes, lowest first
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def stream_bytes(wq: Tensor) -> Tensor:
    """Words (rows, words) -> their bytes (rows, words·4) uint8 in stream order."""
    if LITTLE_ENDIAN:
        return wq.contiguous().view(torch.uint8)
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=wq.device)
    return ((wq.unsqueeze(-1) >> shifts) & 255).to(torch.uint8).view(wq.shape[0], -1)


def unpack_shift(wq: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """The reference unpack: words (rows, words) -> a new (rows, words·32/bits) tensor of dtype,
    by shifting words (4, 8 bits) or chunks of the stream (5, 6 bits)."""
    if 32 % bits == 0:
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=wq.device)
        q = (wq.unsqueeze(-1) >> shifts).bitwise_and_(2**bits - 1)
        return q.to(dtype).view(wq.shape[0], wq.shape[1] * 32 // bits)
    out = torch.empty(wq.shape[0], wq.shape[1] * 32 // bits, dtype=dtype, device=wq.device)
    return _chunks_into(stream_bytes(wq), bits, out)


def unpack_values(wq: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """The quantized values q (rows, in) of packed words (rows, words), as dtype."""
    out = torch.empty(wq.shape[0], wq.shape[1] * 32 // bits, dtype=dtype, device=wq.device)
    return unpack_into(wq, bits, out)


def unpack_into(wq: Tensor, bits: int, out: Tensor) -> Tensor:
    """Unpack words (rows, words) into out (rows, words·32/bits), converting as it writes.
    4-bit: each byte 0xHL becomes the int16 0x0H0L = b + 15·(b & 0xF0), whose two bytes in
    memory are L, H: the values in order, as uint8, ready to convert (contiguous, vectorized
    int16 ops on the packed bytes, where two strided nibble copies were not)."""
    if not LITTLE_ENDIAN and bits in (4, 8):
        return out.copy_(unpack_shift(wq, bits, out.dtype))
    b = stream_bytes(wq)
    if bits == 8:
        return out.copy_(b)
    if bits != 4:
        if tracing():  # exported programs: the edge formulation (no strided in-place writes)
            return out.copy_(unpack_bytes_int(b, bits))
        return _chunks_into(b, bits, out)
    if tracing():  # exported programs keep the uint8 ops they had (what lowering knows)
        pairs = out.view(b.shape[0], b.shape[1], 2)
        pairs[..., 0].copy_(b & 15)
        pairs[..., 1].copy_(b >> 4)
        return out
    t = b.to(torch.int16)
    return out.copy_(t.add_(t & 0xF0, alpha=15).view(torch.uint8))


def _chunks_into(b: Tensor, bits: int, out: Tensor) -> Tensor:
    """Stream bytes (rows, in·bits/8) -> out (rows, in), value j of every chunk at a time: one
    or two int32 planes of (rows, in/8) alive, shifted and masked in place."""
    rows = b.shape[0]
    chunk = b.view(rows, -1, bits)
    o = out.view(rows, -1, 8)
    for j, (i, s, over) in enumerate(_starts(bits)):
        v = chunk[..., i].to(torch.int32)
        if over:
            v.add_(chunk[..., i + 1].to(torch.int32).mul_(256))
        v >>= s
        o[..., j].copy_(v.bitwise_and_(2**bits - 1))
    return out


def unpack_bytes_int(wb: Tensor, bits: int) -> Tensor:
    """Stream bytes (rows, in·bits/8) -> values (rows, in) int32 in core ATen integer ops: no
    shift (floor division by 2^s, exact on these non-negative int32s), no dtype view."""
    rows = wb.shape[0]
    t = wb.to(torch.int32).view(rows, -1, bits)
    vals = []
    for i, s, over in _starts(bits):
        v = t[:, :, i]
        if over:
            v = v + t[:, :, i + 1] * 256
        if s:
            v = torch.div(v, 2**s, rounding_mode="floor")
        vals.append(torch.bitwise_and(v, 2**bits - 1))
    return torch.stack(vals, -1).view(rows, -1)


def packed_bytes(wq: Tensor) -> Tensor:
    """The packed words as bytes ``(rows, in * bits // 8)`` uint8: the same memory, the stream of
    the module docstring (4 bits: byte k holds values 2k (low nibble) and 2k + 1; 8 bits: value
    k; 5, 6 bits: chunks of `bits` bytes). The form edge programs read (no dtype view there)."""
    if not LITTLE_ENDIAN:
        raise MespError("packed bytes for edge runtimes need a little-endian host")
    return wq.contiguous().view(torch.uint8)


def unpack_bytes_core_aten(wb: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """As :func:`unpack_values`, from :func:`packed_bytes`, in core ATen ops. 4 and 8 bits in
    float ops (edge runtimes: no ``>>``, no dtype view, and float ops are what an accelerated
    backend such as XNNPACK takes): bytes 0..255 convert exactly, /16 is a power-of-two
    scaling, floor and the subtraction stay on small integers. 5 and 6 bits in int32 ops
    (:func:`unpack_bytes_int`: a straddling value spans two bytes, which bf16 cannot hold
    exactly), converted at the end (values up to 63: exact in every float dtype)."""
    if bits not in (4, 8):
        return unpack_bytes_int(wb, bits).to(dtype)
    b = wb.to(dtype)
    if bits == 8:
        return b
    hi = torch.floor(b * 0.0625)
    lo = b - hi * 16
    return torch.stack([lo, hi], -1).view(wb.shape[0], wb.shape[1] * 2)
