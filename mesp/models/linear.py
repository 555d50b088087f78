"""Frozen base weights (dense or MLX-quantized) and the LoRA linear built on them.

A quantized base is dequantized on the fly: one weight at a time, used, dropped. The base matmul
goes through `_FrozenMatmul`, which saves nothing for backward (the base is frozen, so no weight
gradient is needed, and the weight is re-dequantized from the packed buffers when dx is needed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mesp.errors import MespError
from mesp.ops import int4_mm, native
from mesp.ops.matmul import (
    BlockFill,
    add_product,
    computes_in_fp32,
    linear,
    linear_blocks,
    matmul,
    matmul_blocks,
)
from mesp.quant import (
    QuantSpec,
    dequantize,
    dequantize_gather,
    dequantize_rows,
    quantize,
    tracing,
)

log = logging.getLogger("mesp")


_WARNED: set[tuple[int, int]] = set()


class FrozenWeight(nn.Module):
    """A frozen (out, in) matrix stored dense or as MLX-layout packed words + scales + biases.

    Buffers use MLX's names (`weight`, `scales`, `biases`) so state dicts match MLX checkpoints.
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.quant: QuantSpec | None = None
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("scales", None)
        self.register_buffer("biases", None)
        self.int4: int4_mm.Int4Pack | None = None  # decode-only copy (see pack_for_decoding)

    def set_dense(self, w: Tensor, quant: QuantSpec | None = None) -> None:
        """Store w (out, in); quantize it first when `quant` is given and the input size splits
        into whole groups (MLX's layout needs that; such a weight stays dense, with a warning)."""
        if quant is not None and w.shape[1] % quant.group_size:
            if (w.shape[1], quant.group_size) not in _WARNED:  # once per size, not per weight
                _WARNED.add((w.shape[1], quant.group_size))
                log.warning(
                    "kept weights with %d inputs dense: not a multiple of group size %d",
                    w.shape[1],
                    quant.group_size,
                )
            quant = None
        if quant is None:
            self.quant, self.scales, self.biases, self.int4 = None, None, None, None
            self.weight = w.contiguous()
            return
        if w.is_meta:  # a model for memory accounting only: the packed layout, no values
            out_f, groups = w.shape[0], w.shape[1] // quant.group_size
            wq = torch.empty(out_f, quant.words(w.shape[1]), dtype=torch.int32, device="meta")
            sb = [torch.empty(out_f, groups, dtype=w.dtype, device="meta") for _ in range(2)]
            self.set_packed(wq, *sb, quant)
            return
        self.set_packed(*quantize(w, quant), quant)

    def set_packed(self, wq: Tensor, scales: Tensor, biases: Tensor, quant: QuantSpec) -> None:
        self.quant, self.int4 = quant, None
        self.weight = wq.contiguous()
        self.scales = scales.contiguous()
        self.biases = biases.contiguous()

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype if self.scales is not None else self.weight.dtype

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """The (out, in) weight in `dtype`; a fresh temporary when quantized."""
        if self.quant is None:
            return self.weight if dtype is None else self.weight.to(dtype)
        return dequantize(self.weight, self.scales, self.biases, self.quant, dtype)

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (..., in) Wᵀ (+ bias) in x.dtype, as `mesp.ops.matmul.linear` on the dense weight
        (which also serves autograd: the blocked path writes into its outputs)."""
        if self._blocked(x) and not (torch.is_grad_enabled() and x.requires_grad):
            shape, g = (self.out_features, self.in_features), self.quant.group_size
            return linear_blocks(x, self._fill_fp32(x.dtype), shape, g, bias)
        return linear(x, self.dense(x.dtype), bias)

    def matmul(self, dy: Tensor) -> Tensor:
        """dy (..., out) W in dy.dtype, as `mesp.ops.matmul.matmul` on the dense weight."""
        if self._blocked(dy) and not (torch.is_grad_enabled() and dy.requires_grad):
            shape, g = (self.out_features, self.in_features), self.quant.group_size
            return matmul_blocks(dy, self._fill_fp32(dy.dtype), shape, g)
        return matmul(dy, self.dense(dy.dtype))

    def _blocked(self, t: Tensor) -> bool:
        """Whether a matmul with t dequantizes this base block by block (ops.matmul.linear_blocks):
        a quantized base the native kernel serves, and an fp32 GEMM (fp32, or bf16 where the
        CPU has no bf16 GEMM, its bf16 values dequantized straight into fp32: the same numbers
        as dequantizing to bf16 and upcasting, one pass fewer)."""
        return (
            self.quant is not None
            and (t.dtype == torch.float32 or (t.dtype == torch.bfloat16 and computes_in_fp32(t)))
            and t.device.type in ("cpu", "meta")
            and not tracing()  # exported programs keep quant's traceable ops
            and native.serves(self.weight, self.scales, self.biases)
            and native.library() is not None
        )

    def _fill_fp32(self, dtype: torch.dtype) -> BlockFill:
        """W[rows, cols] as `dtype` would round it, written into fp32 `out` (cols: whole groups)."""
        q, bf16 = self.quant, dtype == torch.bfloat16
        assert q is not None
        p = native.packed(self.weight, self.scales, self.biases, q.bits, q.group_size)
        if p is None:
            raise MespError("the native dequantizer is not available for this weight")
        g = q.group_size

        def fill(rows: slice, cols: slice, out: Tensor) -> None:
            r0, r1, _ = rows.indices(p.rows)
            c0, c1, _ = cols.indices(self.in_features)
            if not p.into(out, (r0, r1), (c0 // g, c1 // g), bf16):
                raise MespError(f"the native dequantizer declined a {tuple(out.shape)} block")

        return fill

    def rows(self, start: int, stop: int, dtype: torch.dtype | None = None) -> Tensor:
        """Rows start:stop, e.g. a vocabulary slice of an embedding used as the LM head."""
        if self.quant is None:
            return self.weight[start:stop]
        return dequantize_rows(
            self.weight, self.scales, self.biases, self.quant, start, stop, dtype
        )

    def gather(self, ids: Tensor) -> Tensor:
        """Rows at ids (embedding lookup): ids.shape + (in,)."""
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return dequantize_gather(self.weight, self.scales, self.biases, self.quant, ids)

    def int4_capable(self) -> bool:
        """A 4-bit CPU weight: one the int4 decode kernel can serve."""
        return self.quant is not None and int4_mm.supported(self.weight, self.quant)

    def pack_for_decoding(self) -> bool:
        """Add the int4 kernel's copy of a 4-bit CPU weight (once); True when it has one.
        Inference only: matmuls of short rows without a gradient then use it."""
        if not self.int4_capable():
            return False
        if self.int4 is None or self.int4.source != _identity(self.weight, self.scales):
            self.int4 = int4_mm.pack(self.weight, self.scales, self.biases, self.quant)
            self.int4.source = _identity(self.weight, self.scales)
        return True

    def decode_pack(self, x: Tensor) -> int4_mm.Int4Pack | None:
        """The int4 copy when it should serve x: short CPU rows, copy still of these buffers."""
        p = self.int4
        if p is None or x.device.type != "cpu" or not int4_mm.short_rows(x):
            return None
        return p if p.source == _identity(self.weight, self.scales) else None

    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in self.buffers())
        return own + (self.int4.nbytes() if self.int4 is not None else 0)


def _identity(*ts: Tensor) -> tuple[int, ...]:
    """Storage address and in-place version of each tensor: changes when the buffers do."""
    return tuple(v for t in ts for v in (t.data_ptr(), t._version))


class _FrozenMatmul(torch.autograd.Function):
    """y = x Wᵀ with W frozen. Backward: dx = dy W, W re-materialised from the packed base."""

    @staticmethod
    def forward(x: Tensor, fw: FrozenWeight) -> Tensor:  # type: ignore[override]
        return fw.linear(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
        ctx.fw = inputs[1]

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return ctx.fw.matmul(dy), None


def frozen_matmul(x: Tensor, fw: FrozenWeight) -> Tensor:
    """x (..., in) -> (..., out). Autograd keeps no activation and no dequantized weight."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _FrozenMatmul.apply(x, fw)
    p = fw.decode_pack(x)
    if p is not None:
        return int4_mm.int4_linear(x, p)
    return fw.linear(x)


@contextmanager
def int4_decoding(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within: every 4-bit CPU weight of `model` carries the int4 kernel's copy, so matmuls of
    short rows without a gradient (decode steps) skip dequantize. Yields the bytes the copies
    take; the copies made here are dropped on exit, so training never carries them."""
    added = []
    if enabled:
        for m in model.modules():
            if isinstance(m, FrozenWeight) and m.int4 is None and m.pack_for_decoding():
                added.append(m)
    try:
        yield sum(m.int4.nbytes() for m in added if m.int4 is not None)
    finally:
        for m in added:
            m.int4 = None


class Linear(FrozenWeight):
    """y = x Wᵀ + b + s·(x Aᵀ) Bᵀ. W, b frozen buffers; A (r, in), B (out, r) the only parameters.

    Subclassing FrozenWeight keeps HF/MLX state-dict names: `q_proj.weight`, `q_proj.scales`, …
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(out_features, in_features, dtype)
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)
        self.register_parameter("lora_A", None)
        self.register_parameter("lora_B", None)
        self.lora_scale = 0.0
        # DP-SGD: the step's per-example clipper (engines/clipping.py) while one is attached;
        # under autograd the linear then runs through it, and mesp's hand backward asks it
        self.per_example: Any = None

    def add_lora(
        self, rank: int, scale: float, dtype: torch.dtype, generator: torch.Generator | None = None
    ) -> None:
        """A: Kaiming-uniform (a=√5, as nn.Linear and PEFT), B: zeros: the adapter starts at 0."""
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) bound on fan_in
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype))
        self.lora_scale = float(scale)

    def remove_lora(self) -> None:
        self.lora_A, self.lora_B, self.lora_scale = None, None, 0.0

    @property
    def rank(self) -> int:
        return 0 if self.lora_A is None else self.lora_A.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        if self.per_example is not None and self.lora_A is not None and torch.is_grad_enabled():
            return self.per_example.forward(self, x)  # type: ignore[no-any-return]
        y = frozen_matmul(x, self)
        if self.bias is not None:
            y = y + self.bias
        if self.lora_A is not None:  # y += s·h Bᵀ in the GEMM, h = x Aᵀ (…, r)
            h = linear(x, self.lora_A)
            y = add_product(y, h, self.lora_B.t(), self.lora_scale)
        return y
