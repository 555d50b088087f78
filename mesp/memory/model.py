"""The analytic memory model: peak bytes of one training step, per engine, from the shapes alone.

Symbols: B rows of S positions, T = B·S tokens (all trained: the worst case), D hidden,
F intermediate, Q = H·d query width, K = KV·d key/value width, L layers, V vocabulary, r LoRA
rank, e the compute dtype's bytes, f = max(e, 4) (norms, activation derivatives and log-softmax
run in fp32), c = min(512, T) CE rows per chunk, V' = V, or 8192 when the head is sliced.
W(o, i; x) is dequantizing an o×i weight and then allocating x bytes: o·i·e + max(u, x), u the
4-bit unpack's scratch, two int16 planes of the row block being unpacked, 2·i·min(o, ⌊4 MiB /
(i·e)⌋) bytes (freed before x exists; 0 where mesp.ops.native dequantizes in one sweep); a
dense base is used in place: x. A block projection in fp32 on the native kernel never holds its
whole weight (mesp.ops.matmul.linear_blocks): W is x + one fp32 block of about 1 MiB, rows of
W when o ≥ i, else whole groups of its columns.

State, live for the whole step:
  weights      `mesp.loading.info.weight_bytes` (packed when quantized)
  adapter      Σ_layers Σ_targets r·(in + out)·e;  grads the same (none for mezo)
  optimizer    AdamW 2 × adapter (exp_avg, exp_avg_sq); SGD and mezo 0
  checkpoints  mebp, mesp: L·T·D·e (each block's input; the last output is held beside them)
  tables       RoPE cos/sin 2·S·d·e per layer type (+ S² bytes of window mask, Gemma3)

Peak = the largest of these moments, each the state then live plus its working set:
  block forward, no autograd   4TD·e (n1, a, x2, n2: Block.forward's locals) + the max of
                               4TF·e (gate, up, act(gate), act·up) and 3TF·e + down's output
                               W(D, F; TD·e) or its LoRA sum 3TD·e; attention moments are
                               smaller unless Q ≫ F (or a windowed mask S²·e is built)
  mesp block backward          dy TD·e + tape (n1, x2, n2, q, k, v, o, lse, gate, up; q/k-norm
                               inputs; Gemma3's a, d) + max of: the gated-activation backward,
                               nine T×F fp32 tensors = 9·TF·f (gate, up, dm, σ or tanh, a, a',
                               d_up, dm·up, d_gate; in bf16 the fp32 copies take the same room);
                               down's backward 3TF·e + W(D, F; TF·e); the recompute forward
  mesp cross-entropy           h, hn 2TD·e + rows 2TD·e (trained rows, their gradient)
                               + W(V', D; c·V'·f + c·V'·e·[e < 4] + c·D·e)
  mesp keeping k tapes         (budget-aware recompute) the last k blocks' tapes, recorded in
                               the forward: k−1 of them beside a kept block's forward (its own
                               tape growing to whole, then its output beside it, 2TD·e), all k
                               through the cross-entropy, k−1 beside the first block backward
  autograd (bp all blocks,     per block: n1, n2 (TD·e each, for dA), x2 and the block input as
  mebp one block)              the norms' fp32 inputs (TD·f), 1/rms (T·4 per norm), q, k, v, o
                               T(2Q + 2K)·e, lse B·H·S·4, gate, up, act(gate), act·up 4TF·e,
                               h = x Aᵀ T·r·e per adapter. _FrozenMatmul saves nothing. The MLP's
                               backward adds max(TF·e + W(D, F; TF·e), 3TF·e), less act·up.
  full-logits CE (bp, mebp)    max(3·T·V·4: log-softmax output, d nll and d log-softmax, fp32;
                               T·V·e + W(V, D; TD·e): d logits through the dequantized head)
  mezo                         T·D·e + the block forward, or hn + rows + the CE chunk without a
                               gradient; perturbing adds one z, the largest adapter tensor

`predict` splits the peak into weights, adapter, optimizer, the gradients live then,
checkpoints, logits (the loss head's term above, when the peak is the cross-entropy moment) and
working (everything else: activations, temporaries, RoPE tables); they sum to `total`.

`analytic_floor` is what any exact block-wise gradient must hold beside the weights: LoRA
parameters and gradients + checkpoints + the largest single-block working set + one CE chunk.
`tests/test_memory_model.py` checks `predict` against `mesp.memory.tracker` on real steps.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mesp.config import SLIDING, ModelConfig
from mesp.errors import MespError
from mesp.loading.info import weight_bytes
from mesp.models import FAMILIES
from mesp.models.transformer import LORA_TARGETS
from mesp.ops import native
from mesp.ops.matmul import WEIGHT_BLOCK_BYTES
from mesp.quant import DEQUANT_BLOCK, QuantSpec

ENGINES = ("bp", "mebp", "mesp", "mezo")
CE_ROWS, VOCAB_CHUNK = 512, 8192  # MeSPEngine's and MeZOEngine's chunked-CE defaults


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
    softcap: bool
    tables: int  # RoPE cos/sin tables and the sliding-window mask, bytes
    window_mask: int  # the additive (S, S) mask a windowed flash-attention call builds, bytes
    torch_unpack: bool = True  # the pure-torch dequantizer (not mesp.ops.native's one sweep)
    blocked: bool = False  # projections dequantized block by block (fp32 on the native kernel)

    @property
    def T(self) -> int:
        return self.B * self.S

    def deq(self, out: int, inp: int, then: int = 0) -> int:
        """Peak bytes of dequantizing an out×inp weight and then allocating `then` bytes beside
        it: the weight plus the larger of the 4-bit unpack's scratch (two int16 planes of one
        row block, see quant.DEQUANT_BLOCK; freed once unpacked; none where the native
        kernel dequantizes in one sweep) and `then`. A dense base is used in place: `then`."""
        q = self.quant
        if q is None or inp % q.group_size:
            return then
        block_rows = min(out, max(1, DEQUANT_BLOCK // (inp * self.e)))
        scratch = 2 * block_rows * inp if q.bits == 4 and self.torch_unpack else 0
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

    def lin_in_out(self) -> dict[str, tuple[int, int]]:
        D, F, Q, K = self.D, self.F, self.Q, self.K
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
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad:
        raise MespError(f"unknown LoRA target(s) {bad}; choose from {list(LORA_TARGETS)}")
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
        tables=tables,
        window_mask=windowed * seq_len * seq_len * e,
    )


def adapter_bytes(s: Sizes) -> int:
    io = s.lin_in_out()
    return s.L * sum(s.r * (io[t][0] + io[t][1]) for t in s.targets) * s.e


def block_adapter_bytes(s: Sizes) -> int:
    return adapter_bytes(s) // s.L


# ---- moments of the working set (bytes beyond what the caller counts as live) ----------------


def _norm_peak(s: Sizes, width: int) -> int:
    """RMSNorm forward transients on (T, width): x·r and x·r·w in fp32, plus the fp32 copy of
    x when the compute dtype is narrower."""
    return (2 + (s.e < s.f)) * s.T * width * s.f


def _linear_peak(s: Sizes, name: str) -> int:
    """A frozen linear (+ bias) (+ LoRA) forward: the output and its dequantized weight, or
    y, s·hB and their sum side by side. Result: T·out·e."""
    inp, out = s.lin_in_out()[name]
    lora = name in s.targets
    y = s.T * out * s.e
    return max(s.proj(out, inp, then=y), (3 if lora else 2) * y)


def _mlp_tile(s: Sizes) -> Sizes | None:
    """Sizes of one MLP tile when no-grad passes run the MLP in token tiles (MLP.tile)."""
    from mesp.models.transformer import MLP

    return replace(s, B=1, S=MLP.tile) if s.T > MLP.tile else None


def block_forward_peak(s: Sizes, tape: bool) -> int:
    """No-grad block forward, beyond its input x. Block.forward keeps n1, a, x2, n2 as locals to
    its end; the MLP holds gate and up while act(gate)·up and down run. With a tape (mesp's
    recompute) q, k, v, o, lse (and q/k-norm inputs, Gemma3's a and d) stay alive as well."""
    T, D, F, Q, K, e = s.T, s.D, s.F, s.Q, s.K, s.e
    lse = s.B * s.H * s.S * 4
    qk = T * (2 * Q + 2 * K) * e + lse  # q, k, v after RoPE, o
    qk_in = s.qk_norm * T * (Q + K) * e
    attn = max(
        T * D * e + _linear_peak(s, "q_proj"),
        T * D * e + T * Q * e + 2 * T * K * e + 3 * T * Q * e,  # RoPE of q beside pre-RoPE q,k,v
        T * D * e + T * (2 * Q + 2 * K) * e + 3 * T * K * e,  # RoPE of k
        T * D * e + qk + s.window_mask,  # flash attention with a window
        T * D * e + qk + _linear_peak(s, "o_proj"),
    )
    kept = (tape * qk + tape * qk_in) if tape else 0
    mlp_in = 4 * T * D * e + kept  # n1, a, x2, n2
    m = _mlp_tile(s)  # tiled: the output buffer, then one tile's gate, up, ... at a time
    mlp = mlp_in + (T * D * e if m else 0)
    m = m or s
    mlp += max(
        m.T * F * e + _linear_peak(m, "up_proj"),
        4 * m.T * F * e,  # gate, up, act(gate), product
        3 * m.T * F * e + _linear_peak(m, "down_proj"),
    )
    norm2 = 3 * T * D * e + kept + _norm_peak(s, D)
    return max(attn, mlp, norm2, _norm_peak(s, D))


def tape_bytes(s: Sizes) -> int:
    """What mesp's recompute records for one block's hand backward (see mesp/engines/mesp.py)."""
    T, e = s.T, s.e
    td = T * s.D * e * (3 + 2 * s.sandwich)  # n1, x2, n2 (+ a, d)
    attn = T * (2 * s.Q + 2 * s.K) * e + s.B * s.H * s.S * 4  # q, k, v, o, lse
    qk_in = s.qk_norm * T * (s.Q + s.K) * e
    return td + attn + qk_in + (0 if _mlp_tile(s) else 2 * T * s.F * e)  # + gate, up


def mesp_block_backward_peak(s: Sizes) -> int:
    """Beyond checkpoints, x and dy: the recompute, then the MLP half of the hand backward.
    The gated-activation backward (ATen's fused act' kernel) holds gate, up, dm, dm·up and
    d_gate, then d_gate and d_up beside the first three: five T×F tensors in the compute dtype."""
    T, F, D, e = s.T, s.F, s.D, s.e
    tiled = _mlp_tile(s)
    # tiled: gate/up are not on the tape; dn2 (T×D) is allocated first, then every MLP term
    # below exists for one tile at a time, including the recompute of gate and up
    tape_attn = tape_bytes(s) - (0 if tiled else 2 * T * F * e)
    base = tape_attn + (T * D * e if tiled else 0)
    m = tiled or s
    Tm = m.T
    act = base + 5 * Tm * F * e
    dd = s.sandwich * T * D * e  # Gemma3: the gradient through the post-MLP norm
    down = base + dd + 3 * Tm * F * e + s.proj(D, F, then=Tm * F * e)
    up = base + 2 * Tm * F * e + Tm * D * e + s.proj(F, D, then=Tm * D * e)
    if tiled:
        up = max(up, base + Tm * F * e + _linear_peak(m, "up_proj"))
    # attention backward: da, do, dq, dk, dv (and the window mask) beside the tape
    attn = tape_attn + T * D * e * (1 + s.sandwich) + T * (2 * s.Q + 2 * s.K) * e + s.window_mask
    return max(block_forward_peak(s, tape=True), act, down, up, attn)


def autograd_saved_block(s: Sizes, grad_input: bool) -> int:
    """Activations autograd keeps for one block's backward (bp, mebp). `grad_input`: the block's
    input needs a gradient, so the first norm keeps its (fp32) input too."""
    T, D, F, e, f = s.T, s.D, s.F, s.e, s.f
    tg = set(s.targets)
    out = T * (2 + 2 * s.sandwich) * 4  # each norm's 1/rms
    out += T * D * f * (1 + 2 * s.sandwich)  # x2 (+ a, d) as the norms' fp32 inputs
    out += grad_input * T * D * f
    out += bool(tg & {"q_proj", "k_proj", "v_proj"}) * T * D * e  # n1 for dA
    out += bool(tg & {"gate_proj", "up_proj"}) * T * D * e  # n2 for dA
    out += T * (2 * s.Q + 2 * s.K) * e + s.B * s.H * s.S * 4  # q, k, v, o, lse
    out += s.qk_norm * T * (s.Q + s.K) * f
    out += 3 * T * F * e + ("down_proj" in tg) * T * F * e  # gate, up, act(gate), act·up
    out += len(tg) * T * s.r * e  # h = x Aᵀ per adapter
    return out


def autograd_block_backward_extra(s: Sizes) -> int:
    """Transient of one block's autograd backward beyond its saved set: down's input gradient
    from the adapter and from the (dequantized) base, then their sum; act·up is freed first."""
    T, F, e = s.T, s.F, s.e
    return -("down_proj" in s.targets) * T * F * e + max(
        T * F * e + s.proj(s.D, F, then=T * F * e), 3 * T * F * e
    )


def full_ce_peak(s: Sizes) -> int:
    """bp/mebp's head: (T, V) logits, fp32 log-softmax; beyond the final hidden state."""
    T, V, e = s.T, s.V, s.e
    tv4 = T * V * 4
    cap = s.softcap * T * V * e  # tanh(z / cap), kept for backward
    fwd = T * s.D * e + s.deq(V, s.D, then=T * V * e)
    lsm = T * V * e + (e < 4) * tv4 + tv4
    bwd = 3 * tv4
    head_bwd = T * V * e + s.deq(V, s.D, then=T * s.D * e)
    return cap + max(fwd, lsm, bwd, head_bwd)


def chunked_ce_peak(s: Sizes, grad: bool, chunk_rows: int = CE_ROWS) -> int:
    """mesp/mezo's CE over n = T trained rows, beyond the final normed states: the rows
    (and their gradient), one (c, V') logits block in fp32 and one head slice."""
    n, D, e, f = s.T, s.D, s.e, s.f
    c = min(chunk_rows, n)
    sliced = VOCAB_CHUNK < s.V
    vw = VOCAB_CHUNK if sliced else s.V
    rows = n * D * e * (1 + grad) + 2 * n * 8
    z = c * vw * f + c * vw * e * (e < f) + grad * c * D * e
    if sliced:
        rows += 3 * n * f + grad * n * D * f  # running max / sum / target logit, fp32 dh
    return rows + s.deq(vw, D, then=z)


# ---- the whole step -------------------------------------------------------------------------


def resident_weight_bytes(cfg: ModelConfig, quant: QuantSpec | None, dtype: torch.dtype) -> int:
    """Frozen weights as held in memory (packed when quantized); cached per shape, since the
    planner asks for the same shapes many times and each count builds a meta model."""
    return weight_totals(json.dumps(cfg.to_hf(), sort_keys=True, default=str), quant, dtype)[1]


@functools.lru_cache(maxsize=64)
def weight_totals(key: str, quant: QuantSpec | None, dtype: torch.dtype) -> tuple[int, int]:
    wb = weight_bytes(ModelConfig.from_hf(json.loads(key)), quant, dtype)
    return wb["params"], wb["quant_bytes" if quant is not None else "dense_bytes"]


def predict(
    cfg: ModelConfig,
    engine: str,
    seq_len: int,
    batch: int,
    rank: int = 8,
    targets: Sequence[str] = LORA_TARGETS,
    quant: QuantSpec | None = None,
    dtype: torch.dtype = torch.float32,
    optimizer: str = "adamw",
    keep_tapes: int = 0,
) -> dict[str, int | str]:
    """Bytes of each part of one training step and its peak (`total`): the largest of the
    moments in `phase:*`, each the state live then plus that moment's working set.
    `keep_tapes`: mesp keeps the tapes of its last this many blocks (budget-aware recompute)."""
    s = sizes(cfg, seq_len, batch, rank, targets, quant, dtype)
    weights = resident_weight_bytes(cfg, quant, dtype)
    return predict_sizes(s, weights, engine, optimizer, keep_tapes)


def predict_sizes(
    s: Sizes, weights: int, engine: str, optimizer: str, keep_tapes: int = 0
) -> dict[str, int | str]:
    if engine not in ENGINES:
        raise MespError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if keep_tapes and engine != "mesp":
        raise MespError(f"keeping tapes is mesp's (budget-aware recompute), not {engine}'s")
    if optimizer not in ("adamw", "sgd"):
        raise MespError(f"unknown optimizer {optimizer!r}; choose from adamw, sgd")
    T, D, e, L = s.T, s.D, s.e, s.L
    adapter = adapter_bytes(s)
    zo = engine == "mezo"
    grads = 0 if zo else adapter
    opt = 0 if zo or optimizer == "sgd" else 2 * adapter
    ckpt = L * T * D * e if engine in ("mebp", "mesp") else 0
    state = weights + adapter + opt + s.tables
    g1 = 0 if zo else block_adapter_bytes(s)  # grads alive while the last block runs backward
    phases: dict[str, int] = {}
    # the loss head's own working bytes (logits rows or chunks, fp32 log-softmax, the trained
    # rows and their gradient, the dequantized head), part of the cross-entropy moment
    ce = chunked_ce_peak(s, grad=not zo) if engine in ("mesp", "mezo") else full_ce_peak(s)
    head = {"cross-entropy": ce}
    if zo:
        io = s.lin_in_out()
        z = max((s.r * max(io[t]) * e for t in s.targets), default=0)
        phases["perturb"] = state - s.tables + z
        phases["block forward"] = state + T * D * e + block_forward_peak(s, tape=False)
        # the RoPE tables belong to model.hidden and are gone before the loss
        phases["cross-entropy"] = state - s.tables + T * D * e + ce
        saved = 0
    elif engine == "mesp":
        saved = tape_bytes(s)
        k = min(keep_tapes, L)
        kept = k * saved  # the kept tapes, all alive from the last forward to the first backward
        if k < L:  # blocks run without a tape
            phases["forward"] = state + ckpt + block_forward_peak(s, tape=False)
        if k:  # a kept block's forward: the others' tapes, its own, then its output beside it
            own = max(block_forward_peak(s, tape=True), saved + 2 * T * D * e)
            phases["kept forward"] = state + ckpt + kept - saved + own
        phases["cross-entropy"] = state + ckpt + 2 * T * D * e + ce + kept
        bwd = state + g1 + ckpt + T * D * e + mesp_block_backward_peak(s)
        phases["block backward"] = bwd + max(kept - saved, 0)  # the last block's, if kept
    elif engine == "mebp":
        # the final norm keeps h (an fp32 copy when e < 4) and 1/rms for the head's backward
        head_saved = T * D * e + (e < s.f) * T * D * s.f + T * 4
        # in fp32 the first norm's saved input is the checkpoint itself
        saved = autograd_saved_block(s, grad_input=L > 1) - (e >= s.f) * T * D * s.f * (L > 1)
        phases["forward"] = state + ckpt + block_forward_peak(s, tape=False)
        phases["cross-entropy"] = state + ckpt + head_saved + ce
        phases["block backward"] = (
            state + g1 + ckpt + 2 * T * D * e + saved + autograd_block_backward_extra(s)
        )
    else:
        saved = sum(autograd_saved_block(s, grad_input=i > 0) for i in range(L))
        saved += T * D * s.f + T * 4  # the final norm's input and 1/rms
        phases["cross-entropy"] = state + saved + ce
        phases["block backward"] = state + g1 + saved + T * D * e + autograd_block_backward_extra(s)
    if not zo:  # all gradients, the state and one tensor's update temporaries
        phases["optimizer"] = state + grads + (adapter // L if opt else 0)
    peak = max(phases, key=lambda k: phases[k])
    live = {"block backward": g1, "optimizer": grads}.get(peak, 0)
    logits = head.get(peak, 0)
    return {
        "engine": engine,
        "weights": weights,
        "adapter": adapter,
        "grads": grads,  # all of them, as after the backward
        "optimizer": opt,
        "checkpoints": ckpt,
        "saved": saved,  # bp: every block's autograd activations; mebp, mesp: one block's
        "kept_tapes": min(keep_tapes, L) if engine == "mesp" else 0,
        "grads_at_peak": live,
        # the loss head's working bytes at the peak (0 when the peak is outside the loss)
        "logits": logits,
        "loss_head": ce,  # the same bytes at the cross-entropy moment, peak or not
        # everything else live at the peak: activations, temporaries, RoPE tables
        "working": phases[peak] - weights - adapter - opt - ckpt - live - logits,
        "total": phases[peak],
        "peak_at": peak,
        **{f"phase:{k}": v for k, v in phases.items()},
    }


def analytic_floor(
    cfg: ModelConfig,
    seq_len: int,
    batch: int,
    rank: int,
    targets: Sequence[str],
    quant: QuantSpec | None,
    dtype: torch.dtype,
) -> int:
    """Bytes an exact block-wise LoRA gradient needs beside the frozen weights (which can be
    streamed): the LoRA parameters and one block's gradients (SGD keeps no state, and a block's
    gradient can be applied as soon as that block is done) + L block checkpoints + the largest
    single-block working set (mesp's: the incoming gradient, the tape and the MLP backward) + one
    CE chunk of fp32 logits, c·min(V, 8192)·4. A sum of parts, not a max over moments."""
    s = sizes(cfg, seq_len, batch, rank, targets, quant, dtype)
    lora = adapter_bytes(s) + block_adapter_bytes(s)
    ckpt = s.L * s.T * s.D * s.e
    block = s.T * s.D * s.e + mesp_block_backward_peak(s)
    chunk = min(CE_ROWS, s.T) * min(VOCAB_CHUNK, s.V) * 4
    return lora + ckpt + block + chunk
