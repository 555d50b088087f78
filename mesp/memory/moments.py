"""The working set of each moment of a training step, in bytes beyond what the caller counts
as live (mesp.memory.model adds the state): the block forward and mesp's hand backward, the
autograd blocks of bp and mebp, and the full and chunked cross-entropy heads. Formulas and
symbols: mesp.memory.model's docstring."""

from __future__ import annotations

from dataclasses import replace

from mesp.memory.sizes import Sizes

CE_ROWS, VOCAB_CHUNK = 512, 8192  # MeSPEngine's and MeZOEngine's chunked-CE defaults


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
