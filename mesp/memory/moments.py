"""The working set of each moment of a training step, in bytes beyond what the caller counts
as live (mesp.memory.model adds the state): the block forward and mesp's hand backward, the
autograd blocks of bp and mebp, and the full and chunked cross-entropy heads. Formulas and
symbols: mesp.memory.model's docstring."""

from __future__ import annotations

from dataclasses import replace

from mesp.memory.sizes import ATTN_CHUNK, Sizes

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


def _fused_up_peak(s: Sizes) -> int:
    """Phi-3's gate_up_proj without autograd: its (T, 2F) output, the adapter's product added
    into it in place (add_product), beside the dequantized weight. Result: T·2F·e."""
    y = 2 * s.T * s.F * s.e
    return s.proj(2 * s.F, s.D, then=y)


def _capped_fwd(s: Sizes) -> int:
    """The chunked attention forward's transients beyond q, k, v, out and lse (soft-capped
    attention only): the largest chunk's scores beside the previous chunk's (alive until
    reassigned; logsumexp reduces without a temporary of their size), the chunk's bool mask and
    its negation, the expanded k a broadcast matmul copies, the chunk's output rows, and fp32
    copies of q, k, v when the compute dtype is narrower."""
    if not s.capped:
        return 0
    rows = s.B * min(ATTN_CHUNK, s.S) * s.Q * s.f
    expand = s.B * s.Q * s.chunk_keys * s.f
    wide = (s.e < s.f) * s.T * (s.Q + 2 * s.K) * s.f
    return s.scores + s.prev_scores + 2 * s.chunk_mask + rows + expand + wide


def _capped_bwd(s: Sizes) -> int:
    """The chunked attention backward's transients beyond dout, q, k, v, out, lse and dq, dk, dv:
    δ (B, H, S), then per chunk the scores (made p in place), the cap's derivative and ds (three
    score blocks) while the previous chunk's dcap and ds are still bound (two more, of its
    size), the masks, the expanded k or v a broadcast matmul copies, and the chunk's dout and q
    rows flattened (copies); fp32 copies of q, k, v, dout and fp32 dk, dv accumulators when the
    compute dtype is narrower."""
    if not s.capped:
        return 0
    T, f = s.T, s.f
    rows = 2 * s.B * min(ATTN_CHUNK, s.S) * s.Q * f
    expand = s.B * s.Q * s.chunk_keys * f
    wide = (s.e < f) * T * (2 * s.Q + 4 * s.K) * f
    blocks = 3 * s.scores + 2 * s.prev_scores + 2 * s.chunk_mask
    return s.B * s.H * s.S * f + blocks + rows + expand + wide


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
        T * D * e + _linear_peak(s, s.qkv_name),
        T * D * e + T * Q * e + 2 * T * K * e + 3 * T * Q * e,  # RoPE of q beside pre-RoPE q,k,v
        T * D * e + T * (2 * Q + 2 * K) * e + 3 * T * K * e,  # RoPE of k
        T * D * e + qk + s.window_mask + _capped_fwd(s),  # the attention call itself
        T * D * e + qk + _linear_peak(s, "o_proj"),
    )
    kept = (tape * qk + tape * qk_in) if tape else 0
    # n1, a, x2, n2; OLMo 2's n1 is x and its n2 is x2 (the same tensors): a, x2
    mlp_in = (4 - 2 * s.post_norms) * T * D * e + kept
    m = _mlp_tile(s)  # tiled: the output buffer, then one tile's gate, up, ... at a time
    mlp = mlp_in + (T * D * e if m else 0)
    m = m or s
    mlp += max(
        m.T * F * e + _linear_peak(m, "up_proj") if not s.fused else _fused_up_peak(m),
        4 * m.T * F * e,  # gate, up, act(gate), product
        3 * m.T * F * e + _linear_peak(m, "down_proj"),
    )
    norm2 = 3 * T * D * e + kept + _norm_peak(s, D)
    return max(attn, mlp, norm2, _norm_peak(s, D))


def tape_bytes(s: Sizes) -> int:
    """What mesp's recompute records for one block's hand backward (see mesp/engines/mesp.py)."""
    T, e = s.T, s.e
    post = s.sandwich or s.post_norms  # a and d, the branch norms' inputs (Gemma, OLMo 2)
    # n1, x2, n2 (+ a, d); OLMo 2's n1 is the block input x (held anyway) and its n2 is x2
    td = T * s.D * e * (1 + 2 * (not s.post_norms) + 2 * post)
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
    post = s.sandwich or s.post_norms
    dd = post * T * D * e  # Gemma, OLMo 2: the gradient through the post-MLP norm
    down = base + dd + 3 * Tm * F * e + s.proj(D, F, then=Tm * F * e)
    up = base + 2 * Tm * F * e + Tm * D * e + s.proj(F, D, then=Tm * D * e)
    if s.fused:  # gate | up (the caller's call arguments, alive to the end of the MLP piece),
        # dgate, dup and [dgate | dup] beside them; then the fused linear's dx beside [dgate | dup]
        cat = base + 6 * Tm * F * e
        up = max(cat, base + 4 * Tm * F * e + s.proj(2 * F, D, then=Tm * D * e))
    if tiled:
        fwd = _fused_up_peak(m) if s.fused else Tm * F * e + _linear_peak(m, "up_proj")
        up = max(up, base + fwd)
    # attention backward: da, do, dq, dk, dv (and the window mask) beside the tape
    attn = tape_attn + T * D * e * (1 + post) + T * (2 * s.Q + 2 * s.K) * e + s.window_mask
    # under a soft-cap the chunked pair's scores dominate it: by then the tape holds n1 (OLMo 2:
    # x itself), q, k, v, o, lse and q/k-norm inputs, beside dx2, do, dq, dk, dv (da is freed)
    qkvo = T * (2 * s.Q + 2 * s.K) * e
    qk_in = s.qk_norm * T * (s.Q + s.K) * e
    rest = (2 - s.post_norms) * T * D * e + qkvo + s.B * s.H * s.S * 4 + qk_in
    capped = s.capped * (rest + qkvo + _capped_bwd(s))
    # Phi-3: q, k, v, o and lse are freed after the attention backward; dq, dk, dv, their
    # (B, S, ·) copies and the concatenated [dq | dk | dv] beside dx2 and do
    qkv = s.Q + 2 * s.K
    cat = s.fused * (tape_attn - qkvo - s.B * s.H * s.S * 4 + 2 * T * D * e + 3 * T * qkv * e)
    return max(block_forward_peak(s, tape=True), act, down, up, attn, capped, cat)


def autograd_saved_block(s: Sizes, grad_input: bool) -> int:
    """Activations autograd keeps for one block's backward (bp, mebp). `grad_input`: the block's
    input needs a gradient, so the first norm keeps its (fp32) input too."""
    T, D, F, e, f = s.T, s.D, s.F, s.e, s.f
    tg = set(s.targets)
    out = T * (2 + 2 * s.sandwich) * 4  # each norm's 1/rms
    # the norms' fp32 inputs: x2 (+ a, d); OLMo 2's two norms take a and d
    out += T * D * f * (2 if s.post_norms else 1 + 2 * s.sandwich)
    # the first norm's input; OLMo 2 has none (the block input is saved as n1 below)
    out += grad_input * (not s.post_norms) * T * D * f
    out += bool(tg & {"q_proj", "k_proj", "v_proj", "qkv_proj"}) * T * D * e  # n1 for dA
    out += bool(tg & {"gate_proj", "up_proj", "gate_up_proj"}) * T * D * e  # n2 for dA
    out += T * (2 * s.Q + 2 * s.K) * e + s.B * s.H * s.S * 4  # q, k, v, o, lse
    out += s.qk_norm * T * (s.Q + s.K) * f
    out += 3 * T * F * e + ("down_proj" in tg) * T * F * e  # gate, up, act(gate), act·up
    out += len(tg) * T * s.r * e  # h = x Aᵀ per adapter
    return out


def autograd_block_backward_extra(s: Sizes) -> int:
    """Transient of one block's autograd backward beyond its saved set: down's input gradient
    from the adapter and from the (dequantized) base, then their sum; act·up is freed first.
    Under an attention soft-cap the chunked backward (dout, dq, dk, dv and its chunk scores)
    can be larger."""
    T, F, e = s.T, s.F, s.e
    mlp = -("down_proj" in s.targets) * T * F * e + max(
        T * F * e + s.proj(s.D, F, then=T * F * e), 3 * T * F * e
    )
    # the attention's backward runs after the MLP half's, whose saved tensors are freed by
    # then: gate, up, act(gate) (and act·up), n2 and h for its adapters, the fp32 inputs of
    # the norms on that half (x2 before the MLP; Gemma's post-MLP d; OLMo 2's d alone)
    tg = set(s.targets)
    mlp_t = tg & {"gate_proj", "up_proj", "gate_up_proj", "down_proj"}
    norms = 1 + (s.sandwich and not s.post_norms)
    mlp_saved = (3 + ("down_proj" in tg)) * T * F * e + len(mlp_t) * T * s.r * e
    mlp_saved += bool(tg & {"gate_proj", "up_proj", "gate_up_proj"}) * T * s.D * e
    mlp_saved += norms * T * s.D * s.f
    attn = s.capped * (T * (2 * s.Q + 2 * s.K) * e + _capped_bwd(s) - mlp_saved)
    return max(mlp, attn)


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
    # a final soft-cap keeps t = tanh(z/cap) beside the capped logits: a second fp32 block
    z = c * vw * f * (1 + s.softcap) + c * vw * e * (e < f) + grad * c * D * e
    if sliced:
        rows += 3 * n * f + grad * n * D * f  # running max / sum / target logit, fp32 dh
        rows += grad * s.softcap * n * f  # the cap's derivative at each row's target
    return rows + s.deq(vw, D, then=z)
