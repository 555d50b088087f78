"""What a quantized GGUF file's weights become in memory, and what requantizing them costs.

`mesp` keeps llama.cpp's codes as stored by default (gguf_codes.py): the model trained is the
model llama.cpp runs. `--quantize 4|8` dequantizes and quantizes them again to MLX's group-64
layout, a second rounding on top of llama.cpp's; `RequantizeCost` measures it on the file at
hand and says so (SmolLM2-135M Q4_1: perplexity on The Tempest 25.37 -> 32.69, docs/gguf.md).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from mesp.loading.gguf import GGUFFile
from mesp.loading.gguf_codes import STORED, stored_bits
from mesp.quant import QuantSpec, dequantize, quantize, quantized_bytes

log = logging.getLogger("mesp")


class TypeRow(NamedTuple):
    """One ggml type of a file's weight matrices and what it becomes in memory."""

    qtype: str  # ggml type name, e.g. "Q4_1"
    count: int  # weight matrices of this type
    params: int
    file_bits: float  # bits per weight in the file (codes + block scales)
    spec: QuantSpec | None  # MLX layout it is held in; None: dense floats

    def memory_bits(self, dtype: torch.dtype) -> float:
        """Bits per weight in memory: the code's container + a scale and a bias per group."""
        e = torch.tensor([], dtype=dtype).element_size() * 8
        return e if self.spec is None else self.spec.bits + 2 * e / self.spec.group_size


def type_rows(g: GGUFFile, shapes: dict[str, tuple[int, ...]]) -> list[TypeRow]:
    """Per ggml type of the weight matrices named in `shapes` (HF name -> (out, in))."""
    rows: dict[str, list] = {}
    for name, shape in shapes.items():
        if name not in g.names or len(shape) != 2:
            continue
        qt = g.qtype(name)
        spec = STORED[qt][0] if qt in STORED else None
        r = rows.setdefault(qt.name, [0, 0, stored_bits(qt), spec])
        r[0] += 1
        r[1] += shape[0] * shape[1]
    return sorted((TypeRow(k, *v) for k, v in rows.items()), key=lambda r: -r.params)


def describe(g: GGUFFile, shapes: dict[str, tuple[int, ...]]) -> str:
    """'llama.cpp's Q4_1 x210 (4-bit g32), Q8_0 x1 (8-bit g32) as stored' for a run's log."""
    parts = [
        f"{r.qtype} x{r.count}" + (f" ({r.spec.bits}-bit g{r.spec.group_size})" if r.spec else "")
        for r in type_rows(g, shapes)
    ]
    return f"llama.cpp's {', '.join(parts)} as stored"


class RequantizeCost:
    """Measures, while the model loads, what requantizing a GGUF's codes costs: each weight the
    loader reads is quantized once more here, in row blocks, and compared with the file's own
    values (so the measurement holds no more than the tensor the loader already holds), then
    `warn` says the relative error ‖W_requant − W_file‖ / ‖W_file‖ over every such matrix."""

    def __init__(self, g: GGUFFile, quant: QuantSpec) -> None:
        self.g, self.quant, self.err, self.ref, self.types = g, quant, 0.0, 0.0, set()

    @torch.no_grad()
    def tensor(self, hf_name: str) -> torch.Tensor:
        w = self.g.tensor(hf_name)
        qt = self.g.qtype(hf_name)
        if qt not in STORED or w.ndim != 2 or w.shape[1] % self.quant.group_size:
            return w  # kept dense by the loader (FrozenWeight.set_dense), or not a matrix
        self.types.add(qt.name)
        step = max(1, (1 << 20) // w.shape[1])
        for a in range(0, w.shape[0], step):
            part = w[a : a + step]
            back = dequantize(*quantize(part, self.quant), self.quant, torch.float32)
            self.err += float(torch.linalg.vector_norm(back.sub_(part), dtype=torch.float64) ** 2)
            self.ref += float(torch.linalg.vector_norm(part, dtype=torch.float64) ** 2)
        return w

    def warn(self) -> float:
        rel = (self.err / self.ref) ** 0.5 if self.ref else 0.0
        q = self.quant
        seen = " (SmolLM2's Q4_1 at 4 bits: perplexity +29%, docs/gguf.md)" if q.bits == 4 else ""
        log.warning(
            "--quantize %d requantizes this file's %s codes to %d-bit group %d: a second "
            "rounding, %.1f%% relative weight error against the file's own weights%s; leave "
            "--quantize out to train the weights as stored",
            q.bits, "/".join(sorted(self.types)), q.bits, q.group_size, 100 * rel, seen,
        )  # fmt: skip
        return rel


def info_lines(g: GGUFFile, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> list[str]:
    """`mesp info`'s lines for a quantized GGUF: per ggml type, what it becomes and its bits
    per weight in the file and in memory (scales and biases in `dtype`)."""
    rows = type_rows(g, shapes)
    total = sum(r.params * r.memory_bits(dtype) for r in rows) / 8
    out = []
    for i, r in enumerate(rows):
        into = f"MLX {r.spec.bits}-bit g{r.spec.group_size}" if r.spec else "dense"
        out.append(
            f"{'stored' if i == 0 else '':<12} {r.qtype:<5} x{r.count:<4} {r.params / 1e6:7.1f}M "
            f"weights, {r.file_bits:5.2f} bits in the file -> {into}, "
            f"{r.memory_bits(dtype):5.2f} bits in memory"
        )
    out.append(
        f"{'':<12} {total / 2**20:,.1f} MB of weight matrices as stored (--quantize auto); "
        "--quantize 4|8 requantizes them, a second rounding"
    )
    return out


def memory_bytes(g: GGUFFile, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes of the model's frozen tensors (`shapes`: HF name -> shape) loaded as stored:
    codes in their MLX container with a scale and a bias per group, anything else dense."""
    e = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        qt = g.qtype(name) if name in g.names else None
        if qt in STORED and len(shape) == 2:
            total += quantized_bytes(shape[0], shape[1], STORED[qt][0], dtype)
        else:
            total += n * e
    return total
