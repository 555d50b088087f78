"""llama.cpp's quantized blocks -> MLX's affine layout, codes kept as stored (no requantizing).

Every type read here is an affine code per group: w = q·s + b, with q an unsigned integer of
4, 5, 6 or 8 bits, and each is kept at its own width: MLX's 4-, 5-, 6- and 8-bit layouts, each
row a little-endian bit stream with code j at bits bits·j .. (mesp/quant_pack.py). So a code
takes in memory the bits it takes in the file; only the block's scales differ (an fp32 scale and
bias per group here, where the file has an fp16 d or a few bits of sub-block scale).

| type | block                              | q, s, b of the MLX form                 | group |
|------|------------------------------------|-----------------------------------------|-------|
| Q4_0 | d·(q − 8)                          | q, d, −8d                               | 32    |
| Q4_1 | d·q + m                            | q, d, m                                 | 32    |
| Q5_0 | d·(q − 16)                         | q (5 bits), d, −16d                     | 32    |
| Q5_1 | d·q + m                            | q (5 bits), d, m                        | 32    |
| Q8_0 | d·q, q signed                      | q + 128, d, −128d                       | 32    |
| Q4_K | (d·sc)·q − dmin·m, 6-bit sc and m  | q, d·sc, −(dmin·m)                      | 32    |
| Q5_K | as Q4_K, 5-bit q                   | q (5 bits), d·sc, −(dmin·m)             | 32    |
| Q6_K | (d·sc)·(q − 32), 8-bit signed sc   | q (6 bits), d·sc, −32·(d·sc)            | 16    |

Exact in float32, bit for bit against `gguf.quants.dequantize` (tests/test_gguf_codes.py), up
to the sign of a zero: d is an fp16 (11 significant bits), sc at most 7 bits, q at most 8, so
every s, b and q·s above is exact in fp32's 24 bits; where gguf rounds once (q·s + m, Q4_1 /
Q5_1 / K-quants' q·s − dm) MLX's q·s + b rounds at the same place, and where gguf's product
is exact (d·(q − 8) and the like) so is q·s + b, whose true value is that product. In bf16 or
fp16 the scales round (as any weight does in that dtype).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from mesp.quant import QuantSpec

# What each stored type becomes: (MLX bits, group size) and the bits a code takes in the file.
STORED: dict[QT, tuple[QuantSpec, int]] = {
    QT.Q4_0: (QuantSpec(4, 32), 4),
    QT.Q4_1: (QuantSpec(4, 32), 4),
    QT.Q5_0: (QuantSpec(5, 32), 5),
    QT.Q5_1: (QuantSpec(5, 32), 5),
    QT.Q8_0: (QuantSpec(8, 32), 8),
    QT.Q4_K: (QuantSpec(4, 32), 4),
    QT.Q5_K: (QuantSpec(5, 32), 5),
    QT.Q6_K: (QuantSpec(6, 16), 6),
}


def stored_bits(qtype: QT) -> float:
    """Bits per weight in the file (codes + the block's scales)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return size * 8 / block


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) bytes -> (n, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes (n, k·run) -> codes (n, 2·k·run): each run of `run` bytes gives its `run` low
    nibbles, then its `run` high nibbles (the value order of Q4_0 / Q4_K / Q6_K's low bits)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(n, -1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit array (n, count/8 bytes) -> (n, count) values 0/1, bit j = value j."""
    return np.unpackbits(packed, axis=-1, count=count, bitorder="little")


def _kscales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, (n, 8) each."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], -1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], -1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _decode(qtype: QT, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks (n, bytes) -> codes (n, block) uint8, scales and biases (n, groups) float32."""
    n = blk.shape[0]
    if qtype in (QT.Q4_0, QT.Q5_0, QT.Q8_0):
        d = _f16(blk[:, :2])
        if qtype == QT.Q8_0:  # signed byte x + 128 = x ^ 0x80 as an unsigned byte
            return blk[:, 2:] ^ np.uint8(128), d, np.float32(-128) * d
        if qtype == QT.Q4_0:
            return _nibbles(blk[:, 2:], 16), d, np.float32(-8) * d
        q = _nibbles(blk[:, 6:], 16) | (_bits(blk[:, 2:6], 32) << 4)
        return q, d, np.float32(-16) * d
    if qtype in (QT.Q4_1, QT.Q5_1):
        d, m = _f16(blk[:, :2]), _f16(blk[:, 2:4])
        if qtype == QT.Q4_1:
            return _nibbles(blk[:, 4:], 16), d, m
        return _nibbles(blk[:, 8:], 16) | (_bits(blk[:, 4:8], 32) << 4), d, m
    if qtype in (QT.Q4_K, QT.Q5_K):
        d, dmin = _f16(blk[:, :2]), _f16(blk[:, 2:4])
        sc, mn = _kscales(blk[:, 4:16])
        s, b = d * sc, -(dmin * mn)  # (n, 8): one per 32 codes
        if qtype == QT.Q4_K:
            return _nibbles(blk[:, 16:], 32), s, b
        # high bit of code l in sub-block i: bit i of qh[l]
        hi = _bits(blk[:, 16:48].reshape(n, 32, 1), 8).reshape(n, 32, 8).transpose(0, 2, 1)
        return _nibbles(blk[:, 48:], 32) | (hi.reshape(n, 256) << 4), s, b
    if qtype == QT.Q6_K:
        lo = _nibbles(blk[:, :128], 64)  # (n, 256): per half, 64 low then 64 high nibbles
        qh = blk[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        q = lo | ((qh & 3).reshape(n, 256) << 4)
        s = _f16(blk[:, 208:210]) * blk[:, 192:208].view(np.int8).astype(np.float32)
        return q, s, np.float32(-32) * s
    raise ValueError(f"no MLX form for {qtype.name}")


def _stream(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) uint8 -> the rows' little-endian bit streams (rows, cols·bits/8) uint8:
    code j at bits bits·j .. of its row, so 8 codes fill `bits` bytes (4 bits: byte k holds
    codes 2k (low nibble) and 2k + 1; 8 bits: byte k is code k)."""
    if bits == 8:
        return q
    if bits == 4:
        return q[:, 0::2] | (q[:, 1::2] << 4)
    rows = q.shape[0]
    v = q.reshape(rows, -1, 8)
    out = np.zeros((rows, v.shape[1], bits), np.uint8)
    for j in range(8):
        i, s = divmod(bits * j, 8)
        out[..., i] |= v[..., j] << s  # uint8: the bits past this byte drop off
        if s + bits > 8:  # ... and land in the next one
            out[..., i + 1] |= v[..., j] >> (8 - s)
    return out.reshape(rows, -1)


def to_mlx(qtype: QT, raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """A tensor's bytes (as stored, rows of `shape` = (out, in)) -> (words int32 (out, in·bits/32),
    scales float32 (out, in/group), biases float32 (out, in/group)) in MLX's layout."""
    spec, _ = STORED[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    q, s, b = _decode(qtype, raw.reshape(-1, size))
    stream = np.ascontiguousarray(_stream(q.reshape(rows, cols), spec.bits))
    words = stream.view("<i4").astype(np.int32, copy=False)  # 4 stream bytes, lowest first
    groups = cols // spec.group_size
    return words, s.reshape(rows, groups), b.reshape(rows, groups)
