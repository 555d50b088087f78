"""The dimensions the memory model's formulas use (`Sizes`, symbols as in mesp.memory.model),
taken from a model config, and the LoRA adapter's bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mesp.config import FULL, SLIDING, ModelConfig
from mesp.errors import MespError
from mesp.models import FAMILIES
from mesp.models.transformer import FUSED_TARGETS, LORA_TARGETS, is_target
from mesp.ops import native
from mesp.ops.matmul import WEIGHT_BLOCK_BYTES
from mesp.quant import DEQUANT_BLOCK, QuantSpec

ATTN_CHUNK = 256  # query rows per chunk of the exact chunked attention (mesp.ops.attention)


@dataclass(frozen=True)
class Sizes:
    """Every dimension the formulas use (elements), plus byte widths."""

    B: int
    S: int
    D: int
    F: int
    Q: int
    K: int
    H: int
    L: int
    V: int
    r: int
    e: int  # compute dtype bytes
    f: int  # fp32-or-wider math bytes
    quant: QuantSpec | None
    targets: tuple[str, ...]
    qk_norm: bool
    sandwich: bool
    softcap: bool  # a final logit soft-cap (Gemma 2): the loss head holds tanh(z/cap) too
    post_norms: bool  # OLMo 2: no input / pre-MLP norm (n1 = x, n2 = x2), a norm on each branch
    tables: int  # RoPE cos/sin tables and the sliding-window mask, bytes
    window_mask: int  # the additive (S, S) mask a windowed flash-attention call builds, bytes
    # an attention logit soft-cap (Gemma 2): every attention call runs the exact query-chunked
    # pair (mesp.ops.attention_chunked), whose working set is per-chunk (B, H, c, keys) fp32
    # scores and a (c, keys) bool mask, not the flash kernels' (and no additive window mask)
    capped: bool = False
    scores: int = 0  # bytes of the largest chunk's fp32 scores (query rows × keys it sees)
    prev_scores: int = 0  # the chunk before it (its blocks live on into the next iteration)
    chunk_keys: int = 0  # keys that chunk sees (the matmul's expanded copy of k or v)
    chunk_mask: int = 0  # bytes of that chunk's bool mask
    torch_unpack: bool = True  # the pure-torch dequantizer (not mesp.ops.native's one sweep)
    blocked: bool = False  # projections dequantized block by block (fp32 on the native kernel)
    fused: bool = False  # Phi-3: one qkv_proj and one gate_up_proj (targets: the fused names)

    @property
    def T(self) -> int:
        return self.B * self.S

    def deq(self, out: int, inp: int, then: int = 0) -> int:
        """Peak bytes of dequantizing an out×inp weight and then allocating `then` bytes beside
        it: the weight plus the larger of the unpack's scratch (4 bits: two int16 planes of one
        row block, see quant.DEQUANT_BLOCK; 5 and 6 bits: two int32 planes of an eighth of it,
        quant_pack._chunks_into; freed once unpacked; none at 8 bits, nor where the native
        kernel dequantizes in one sweep) and `then`. A dense base is used in place: `then`."""
        q = self.quant
        if q is None or inp % q.group_size:
            return then
        block_rows = min(out, max(1, DEQUANT_BLOCK // (inp * self.e)))
        per_value = {4: 2, 5: 1, 6: 1}.get(q.bits, 0) if self.torch_unpack else 0
        scratch = per_value * block_rows * inp
        return out * inp * self.e + max(scratch, then)

    def proj(self, out: int, inp: int, then: int = 0) -> int:
        """As `deq`, for a block projection's matmul (FrozenWeight.linear / .matmul): where it
        runs blocked (fp32, native kernel: mesp.ops.matmul.linear_blocks) only one fp32 block
        of the weight exists beside `then`, never the whole weight."""
        q = self.quant
        if not self.blocked or q is None or inp % q.group_size:
            return self.deq(out, inp, then)
        step = WEIGHT_BLOCK_BYTES // 4
        if out >= inp:  # rows of W
            block = min(out, max(1, step // inp)) * inp
        else:  # whole groups of W's columns
            block = out * min(inp, max(q.group_size, step // out // q.group_size * q.group_size))
        return then + 4 * block

    @property
    def qkv_name(self) -> str:
        """The linear that makes q (Phi-3: q, k and v in one)."""
        return "qkv_proj" if self.fused else "q_proj"

    @property
    def up_name(self) -> str:
        """The linear that makes up (Phi-3: gate and up in one)."""
        return "gate_up_proj" if self.fused else "up_proj"

    def lin_in_out(self) -> dict[str, tuple[int, int]]:
        D, F, Q, K = self.D, self.F, self.Q, self.K
        if self.fused:
            return {
                "qkv_proj": (D, Q + 2 * K),
                "o_proj": (Q, D),
                "gate_up_proj": (D, 2 * F),
                "down_proj": (F, D),
            }
        return {
            "q_proj": (D, Q),
            "k_proj": (D, K),
            "v_proj": (D, K),
            "o_proj": (Q, D),
            "gate_proj": (D, F),
            "up_proj": (D, F),
            "down_proj": (F, D),
        }


def sizes(
    cfg: ModelConfig,
    seq_len: int,
    batch: int,
    rank: int,
    targets: Sequence[str],
    quant: QuantSpec | None,
    dtype: torch.dtype,
) -> Sizes:
    for flag, v in (("--seq-len", seq_len), ("--batch-size", batch), ("--rank", rank)):
        if v <= 0:
            raise MespError(f"{flag} must be positive, got {v}")
    spec = FAMILIES[cfg.family]
    e = torch.tensor([], dtype=dtype).element_size()
    f = max(e, 4)
    d, types = cfg.head_dim, set(cfg.layer_types)
    tables = 2 * len(types) * seq_len * d * e
    windowed = SLIDING in types and bool(cfg.sliding_window) and cfg.sliding_window < seq_len
    tables += windowed * seq_len * seq_len  # the bool window mask, kept for the whole step
    capped = bool(cfg.attn_logit_softcapping)
    chunks = _attn_chunks(seq_len, cfg.sliding_window if FULL not in types and windowed else 0)
    i = max(range(len(chunks)), key=lambda j: chunks[j][0] * chunks[j][1]) if capped else 0
    (rows, keys), prev = chunks[i], chunks[i - 1] if i else (0, 0)
    score = capped * batch * cfg.num_attention_heads * f
    bad = [t for t in targets if t not in LORA_TARGETS and t not in FUSED_TARGETS]
    if bad:
        raise MespError(f"unknown LoRA target(s) {bad}; choose from {list(LORA_TARGETS)}")
    if spec.fused_proj:  # the linears the targets adapt, as apply_lora picks them
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        targets = [n for n in names if is_target(n, tuple(targets))]
    return Sizes(
        torch_unpack=dtype not in (torch.float32, torch.bfloat16) or native.library() is None,
        blocked=dtype == torch.float32 and native.library() is not None,
        B=batch,
        S=seq_len,
        D=cfg.hidden_size,
        F=cfg.intermediate_size,
        Q=cfg.num_attention_heads * d,
        K=cfg.num_key_value_heads * d,
        H=cfg.num_attention_heads,
        L=cfg.num_hidden_layers,
        V=cfg.vocab_size,
        r=rank,
        e=e,
        f=f,
        quant=quant,
        targets=tuple(targets),
        qk_norm=spec.qk_norm,
        sandwich=spec.sandwich_norms,
        softcap=bool(cfg.final_logit_softcapping),
        post_norms=spec.post_norms,
        tables=tables,
        window_mask=(windowed and not capped) * seq_len * seq_len * e,
        capped=capped,
        scores=score * rows * keys,
        prev_scores=score * prev[0] * prev[1],
        chunk_keys=capped * keys,
        chunk_mask=capped * rows * keys,
        fused=spec.fused_proj,
    )


def _attn_chunks(seq_len: int, window: int) -> list[tuple[int, int]]:
    """(query rows, keys seen) of each chunk of the exact chunked attention: causal, the keys
    up to the chunk's last query; under a window only (no global layer) from the first query's
    window start."""
    out = []
    for i0 in range(0, seq_len, ATTN_CHUNK):
        i1 = min(i0 + ATTN_CHUNK, seq_len)
        out.append((i1 - i0, i1 - (max(0, i0 - window + 1) if window else 0)))
    return out


def adapter_bytes(s: Sizes) -> int:
    io = s.lin_in_out()
    return s.L * sum(s.r * (io[t][0] + io[t][1]) for t in s.targets) * s.e


def block_adapter_bytes(s: Sizes) -> int:
    return adapter_bytes(s) // s.L
