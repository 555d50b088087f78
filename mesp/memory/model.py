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
                               inputs; Gemma3's a, d) + max of: the gated-activation backward
                               (ATen's fused kernel), five T×F tensors = 5·TF·e (gate, up, dm,
                               then dm·up and d_gate, then d_gate and d_up);
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

Two families differ in what they hold. OLMo 2 (post norms): no input or pre-MLP norm, so n1
is the block input and n2 is x2; its tape and locals hold x2, a, d instead. Gemma 2 (soft-caps):
every attention call is the exact query-chunked pair (no flash kernel, so no additive window
mask): the forward holds one chunk's (B, H, ≤256, keys) fp32 scores beside the previous
chunk's, the backward three score blocks beside the previous chunk's two (under autograd after
the MLP's saved set is freed); the capped loss head keeps tanh(z/cap) beside each logits block.

`predict` splits the peak into weights, adapter, optimizer, the gradients live then,
checkpoints, logits (the loss head's term above, when the peak is the cross-entropy moment) and
working (everything else: activations, temporaries, RoPE tables); they sum to `total`.

A preference objective (dpo, orpo; B rows = B/2 pairs) adds no tape: SFT's moments on the same
rows plus the (B, S) fp32 token weights T·4 (twice at mesp's CE, which gathers them), (B,)
log-prob buffers, and its no-tape log-prob passes as moments of their own (`preference_extra`).

`analytic_floor` is what any exact block-wise gradient must hold beside the weights: LoRA
parameters and gradients + checkpoints + the largest single-block working set + one CE chunk.
The dimensions live in sizes.py (`Sizes`), the working set of each moment in moments.py.
`tests/test_memory_model.py` checks `predict` against `mesp.memory.tracker` on real steps.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import torch

from mesp.config import ModelConfig
from mesp.errors import MespError
from mesp.loading.info import weight_bytes
from mesp.memory.moments import (
    CE_ROWS,
    VOCAB_CHUNK,
    autograd_block_backward_extra,
    autograd_saved_block,
    block_forward_peak,
    chunked_ce_peak,
    full_ce_peak,
    mesp_block_backward_peak,
    tape_bytes,
)
from mesp.memory.sizes import Sizes, adapter_bytes, block_adapter_bytes, sizes
from mesp.models.transformer import LORA_TARGETS
from mesp.quant import QuantSpec

ENGINES = ("bp", "mebp", "mesp", "mezo")


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
    weights: int | None = None,
    objective: str = "sft",
) -> dict[str, int | str]:
    """Bytes of each part of one training step and its peak (`total`): the largest of the
    moments in `phase:*`, each the state live then plus that moment's working set.
    `objective` dpo | orpo: `batch` rows hold batch/2 pairs (see `preference_extra`).
    `keep_tapes`: mesp keeps the tapes of its last this many blocks (budget-aware recompute).
    `weights`: the frozen weights' bytes where the file fixes them (a GGUF's codes as stored:
    mesp.loading.info.stored_weight_bytes), else they follow from `quant`."""
    s = sizes(cfg, seq_len, batch, rank, targets, quant, dtype)
    if weights is None:
        weights = resident_weight_bytes(cfg, quant, dtype)
    return predict_sizes(s, weights, engine, optimizer, keep_tapes, objective)


def predict_sizes(
    s: Sizes,
    weights: int,
    engine: str,
    optimizer: str,
    keep_tapes: int = 0,
    objective: str = "sft",
) -> dict[str, int | str]:
    if engine not in ENGINES:
        raise MespError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if keep_tapes and engine != "mesp":
        raise MespError(f"keeping tapes is mesp's (budget-aware recompute), not {engine}'s")
    if optimizer not in ("adamw", "sgd"):
        raise MespError(f"unknown optimizer {optimizer!r}; choose from adamw, sgd")
    if objective not in ("sft", "dpo", "orpo"):
        raise MespError(f"unknown objective {objective!r}; choose from sft, dpo, orpo")
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
        # in fp32 the first norm's saved input is the checkpoint itself; OLMo 2 has no input
        # norm, and the n1 its q/k/v adapters keep is the checkpoint itself
        saved = autograd_saved_block(s, grad_input=L > 1)
        if s.post_norms:
            saved -= bool(set(s.targets) & {"q_proj", "k_proj", "v_proj"}) * T * D * e
        else:
            saved -= (e >= s.f) * T * D * s.f * (L > 1)
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
    if objective != "sft":
        preference_extra(s, engine, objective, state, phases)
    if not zo:  # all gradients, the state and one tensor's update temporaries
        phases["optimizer"] = state + grads + (adapter // L if opt else 0)
    peak = max(phases, key=lambda k: phases[k])
    live = {"block backward": g1, "optimizer": grads}.get(peak, 0)
    logits = head.get(peak, 0)
    return {
        "engine": engine,
        "objective": objective,
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


def preference_extra(s: Sizes, engine: str, objective: str, state: int, phases: dict) -> None:
    """What a DPO / ORPO step (mesp.engines.objective.PreferenceEngine) adds to SFT's step on
    the same B rows (B/2 pairs), in place on `phases`. Its log-prob passes run without a tape:
    DPO's reference (adapters off) and the policy's, each a no-grad forward holding one block's
    working set and then a chunked CE without gradient, the (B,) fp64 counts and log-probs
    (3·B·8: counts, policy, reference or dL/dlp) beside them. Then SFT's step runs with the
    (B, S) fp32 token weights T·4 live throughout; the chunked CE (mesp) also gathers them for
    its trained rows, T·4 more at the cross-entropy moment. The optimizer runs after."""
    if engine == "mezo":
        raise MespError(f"--objective {objective} needs a gradient engine (bp, mebp, mesp)")
    if s.B % 2:
        raise MespError("a preference batch holds (chosen, rejected) pairs: an even row count")
    T, D, e = s.T, s.D, s.e
    lps, tok_w = 3 * s.B * 8, T * 4
    for k in phases:
        phases[k] += tok_w + lps
    if engine == "mesp":
        phases["cross-entropy"] += tok_w
    phases["log-prob forward"] = state + T * D * e + block_forward_peak(s, tape=False) + lps
    # the RoPE tables belong to model.hidden and are gone before the loss
    ce = chunked_ce_peak(s, grad=False)
    phases["log-prob cross-entropy"] = state - s.tables + T * D * e + ce + lps


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
