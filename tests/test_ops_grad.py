"""Every hand-derived backward in mesp.ops against float64 autograd.

Every op's math runs in at least float32 and in float64 for float64 input, so each must match
float64 autograd to 1e-10 relative error. FP32_TOL bounds float32 runs against that reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.config import RopeSpec
from mesp.models.linear import FrozenWeight
from mesp.ops import attention as attn_mod
from mesp.ops.attention import attention_bwd, attention_fwd, sliding_mask
from mesp.ops.cross_entropy import chunked_ce_loss, chunked_ce_loss_and_grad
from mesp.ops.lora_linear import lora_linear, lora_linear_backward, lora_linear_with_h
from mesp.ops.mlp import gated_act, gated_act_backward
from mesp.ops.norm import rms_norm, rms_norm_backward, rms_norm_heads, rms_norm_heads_backward
from mesp.ops.rope import apply_rope, apply_rope_backward, rope_tables
from mesp.quant import QuantSpec

F64 = torch.float64
TOL = 1e-10
FP32_TOL = 2e-6


def rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=F64).to(dtype)


# ---- norm, rope, gated activation ----


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_backward(offset: float) -> None:
    x, w, dy = randn(2, 5, 48, seed=1), randn(48, seed=2) * 0.3, randn(2, 5, 48, seed=3)
    xr = x.clone().requires_grad_()
    ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * (w + offset)
    (gx,) = torch.autograd.grad(ref, xr, dy)
    assert rel(rms_norm(x, w, 1e-6, offset), ref.detach()) < TOL
    assert rel(rms_norm_backward(dy, x, w, 1e-6, offset), gx) < TOL


def test_rms_norm_heads_backward() -> None:
    """OLMo 2's q/k norm: one RMS over all heads of a token, against float64 autograd of the
    HF form (RMSNorm on the (B, S, H·D) projection, then split into heads)."""
    b, h, s, d = 2, 3, 5, 8
    x, w, dy = randn(b, h, s, d, seed=1), randn(h * d, seed=2) * 0.3, randn(b, h, s, d, seed=3)
    xr = x.clone().requires_grad_()
    flat = xr.transpose(1, 2).reshape(b, s, h * d)
    ref = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ref = ref.view(b, s, h, d).transpose(1, 2)
    (gx,) = torch.autograd.grad(ref, xr, dy)
    assert rel(rms_norm_heads(x, w, 1e-6), ref.detach()) < TOL
    assert rel(rms_norm_heads_backward(dy, x, w, 1e-6), gx) < TOL
    # not the per-head norm: the heads share one scale
    per_head = rms_norm(x, w.view(h, 1, d)[0, 0], 1e-6)
    assert rel(per_head, ref.detach()) > 1e-3
    assert torch.autograd.gradcheck(
        lambda t: rms_norm_heads(t, w, 1e-6), (x[:1, :, :2].clone().requires_grad_(),)
    )


ROPES = {
    "default": RopeSpec(theta=10000.0),
    "linear": RopeSpec(theta=10000.0, kind="linear", factor=4.0),
    # original context 64 < S = 77, so the long, medium (ramp) and short bands all occur
    "llama3": RopeSpec(500000.0, "llama3", 8.0, original_max_position_embeddings=64),
    # Phi-4-mini's pieces: 3/4 of each head rotates (18 of 24 dims, 6 pass through); LongRoPE
    # with original context 64 < S = 77 (the long factors) and its attention factor on cos/sin
    "longrope_partial": RopeSpec(
        7000.0,
        "longrope",
        original_max_position_embeddings=64,
        partial_rotary_factor=0.75,
        short_factor=[1.0 + 0.1 * i for i in range(9)],
        long_factor=[1.5 + 0.7 * i for i in range(9)],
        attention_factor=1.19,
    ),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_apply_rope_backward(kind: str) -> None:
    cos, sin = rope_tables(ROPES[kind], 24, 77, torch.device("cpu"), F64)
    x, dy = randn(2, 3, 77, 24, seed=4), randn(2, 3, 77, 24, seed=5)
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(apply_rope(xr, cos, sin), xr, dy)
    assert rel(apply_rope_backward(dy, cos, sin), gx) < TOL
    assert torch.autograd.gradcheck(
        lambda t: apply_rope(t, cos[:5], sin[:5]), (x[:1, :1, :5].clone().requires_grad_(),)
    )


def test_partial_rope_passes_the_rest_through() -> None:
    """Partial rotary: the tables cover 18 of 24 dims; the other 6 are the input, forward and
    backward (the identity's gradient), and the rotated 18 equal a full rotary over them."""
    spec = ROPES["longrope_partial"]
    cos, sin = rope_tables(spec, 24, 77, torch.device("cpu"), F64)
    assert cos.shape == (77, 18)
    x, dy = randn(2, 3, 77, 24, seed=4), randn(2, 3, 77, 24, seed=5)
    y, dx = apply_rope(x, cos, sin), apply_rope_backward(dy, cos, sin)
    assert torch.equal(y[..., 18:], x[..., 18:]) and torch.equal(dx[..., 18:], dy[..., 18:])
    assert torch.equal(y[..., :18], apply_rope(x[..., :18].contiguous(), cos, sin))
    short, _ = rope_tables(spec, 24, 64, torch.device("cpu"), F64)  # 64 positions: short set
    assert not torch.allclose(short, cos[:64])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_act_backward(act: str) -> None:
    g, u, dm = randn(3, 7, 40, seed=6) * 3, randn(3, 7, 40, seed=7), randn(3, 7, 40, seed=8)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    gg, gu = torch.autograd.grad(gated_act(gr, ur, act), (gr, ur), dm)
    dg, du = gated_act_backward(dm, g, u, act)
    assert rel(dg, gg) < TOL and rel(du, gu) < TOL
    # against the derivative written out (float64), independent of ATen's kernels
    if act == "silu":
        sg = torch.sigmoid(g)
        a, da = g * sg, sg * (1 + g * (1 - sg))
    else:
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (g + 0.044715 * g**3))
        a = 0.5 * g * (1 + t)
        da = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g)
    assert rel(dg, dm * u * da) < TOL and rel(du, dm * a) < TOL


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_backward_is_autograds_bits(act: str, dtype: torch.dtype) -> None:
    """In the training dtypes the hand backward runs autograd's own ops: equal bit for bit."""
    g, u, dm = (randn(2, 9, 64, seed=s).to(dtype) for s in (3, 4, 5))
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    gg, gu = torch.autograd.grad(gated_act(gr, ur, act), (gr, ur), dm)
    dg, du = gated_act_backward(dm, g, u, act)
    assert torch.equal(dg, gg) and torch.equal(du, gu) and dg.dtype == dtype


# ---- attention ----

B, H, KV, S, D, SCALE = 2, 6, 2, 77, 24, 24**-0.5


def attn_ref(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Explicit softmax attention in float64, GQA by repeating kv heads."""
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * SCALE
    allow = torch.ones(S, S, dtype=torch.bool).tril() if mask is None else mask
    s = s.masked_fill(~allow, -math.inf)
    return torch.softmax(s, -1) @ v.repeat_interleave(g, 1), torch.logsumexp(s, -1)


def attn_case(window: int | None) -> tuple[Tensor, ...]:
    q, k, v = randn(B, H, S, D, seed=10), randn(B, KV, S, D, seed=11), randn(B, KV, S, D, seed=12)
    dout, mask = randn(B, H, S, D, seed=13), sliding_mask(S, window, torch.device("cpu"))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attn_ref(qr, kr, vr, mask)
    grads = torch.autograd.grad(out, (qr, kr, vr), dout)
    return q, k, v, dout, mask, out.detach(), lse.detach(), *grads


@pytest.mark.parametrize("window", [None, 19], ids=["causal", "sliding19"])
@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_attention_fwd_bwd_fp64(window: int | None, impl: str) -> None:
    q, k, v, dout, mask, out_r, lse_r, gq, gk, gv = attn_case(window)
    out, lse = attention_fwd(q, k, v, SCALE, mask, impl=impl, chunk=16)
    assert out.shape == (B, H, S, D) and lse.shape == (B, H, S)
    assert rel(out, out_r) < TOL and rel(lse, lse_r) < TOL
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, SCALE, mask, impl=impl, chunk=16)
    assert dk.shape == dv.shape == (B, KV, S, D)
    assert rel(dq, gq) < TOL and rel(dk, gk) < TOL and rel(dv, gv) < TOL


def test_attention_expanded_gqa_and_float_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expand-and-sum path for a kernel without native GQA, fed a prebuilt additive mask."""
    monkeypatch.setattr(attn_mod, "_cpu_flash", lambda: (True, False))
    q, k, v, dout, mask, out_r, _, gq, gk, gv = attn_case(19)
    fmask = attn_mod.additive_mask(mask, F64)
    out, lse = attention_fwd(q, k, v, SCALE, fmask)
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, SCALE, fmask)
    assert rel(out, out_r) < TOL
    assert rel(dq, gq) < TOL and rel(dk, gk) < TOL and rel(dv, gv) < TOL


@pytest.mark.parametrize("window", [None, 19], ids=["causal", "sliding19"])
@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_attention_fp32(window: int | None, impl: str) -> None:
    """fp32 inputs against the fp64 reference. The relative error of a float32 dot product of
    length D=24 and of a softmax-weighted sum is a few ulps (~1e-7); 1e-5 leaves room for
    accumulation order and for the ~77-term softmax sums without hiding a wrong formula
    (a missing term or mask error gives errors of order 1e-2 or more)."""
    q, k, v, dout, mask, out_r, _, gq, gk, gv = attn_case(window)
    f = [t.float() for t in (q, k, v, dout)]
    out, lse = attention_fwd(f[0], f[1], f[2], SCALE, mask, impl=impl, chunk=16)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    dq, dk, dv = attention_bwd(f[3], f[0], f[1], f[2], out, lse, SCALE, mask, impl=impl)
    assert rel(out, out_r) < 1e-5
    assert rel(dq, gq) < 1e-5 and rel(dk, gk) < 1e-5 and rel(dv, gv) < 1e-5


@pytest.mark.parametrize("window", [None, 19], ids=["causal", "sliding19"])
def test_attention_softcap_fwd_bwd_fp64(window: int | None) -> None:
    """Gemma 2's logit soft-cap (cap·tanh(s/cap) before the mask) against float64 autograd of
    the explicit form: the chunked pair (whatever impl asks: flash has no cap) and the autograd
    path `attention` takes. cap 1.5 against scores of about unit size: tanh far from linear."""
    cap = 1.5
    q, k, v, dout = (
        randn(B, H, S, D, seed=10),
        randn(B, KV, S, D, seed=11),
        randn(B, KV, S, D, seed=12),
        randn(B, H, S, D, seed=13),
    )
    mask = sliding_mask(S, window, torch.device("cpu"))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    g = H // KV
    sc = qr @ kr.repeat_interleave(g, 1).transpose(-1, -2) * SCALE
    sc = torch.tanh(sc / cap) * cap
    allow = torch.ones(S, S, dtype=torch.bool).tril() if mask is None else mask
    sc = sc.masked_fill(~allow, -math.inf)
    ref = torch.softmax(sc, -1) @ vr.repeat_interleave(g, 1)
    gq, gk, gv = torch.autograd.grad(ref, (qr, kr, vr), dout)
    out, lse = attention_fwd(q, k, v, SCALE, mask, impl="auto", chunk=16, softcap=cap)
    assert rel(out, ref.detach()) < TOL and rel(lse, torch.logsumexp(sc, -1).detach()) < TOL
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, SCALE, mask, chunk=16, softcap=cap)
    assert rel(dq, gq) < TOL and rel(dk, gk) < TOL and rel(dv, gv) < TOL
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out_a = attn_mod.attention(qa, ka, va, SCALE, mask, softcap=cap)
    ga = torch.autograd.grad(out_a, (qa, ka, va), dout)
    assert rel(out_a.detach(), ref.detach()) < TOL
    assert all(rel(x, y) < TOL for x, y in zip(ga, (gq, gk, gv), strict=True))
    # the cap is used: without it the output differs by far more than rounding
    assert rel(attention_fwd(q, k, v, SCALE, mask)[0], ref.detach()) > 1e-3


def test_attention_bf16_chunked_matches_flash() -> None:
    q, k, v, dout, mask, out_r, _, gq, gk, gv = attn_case(19)
    b = [t.bfloat16() for t in (q, k, v, dout)]
    for impl in ("auto", "chunked"):
        out, lse = attention_fwd(b[0], b[1], b[2], SCALE, mask, impl=impl, chunk=32)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        dq, dk, dv = attention_bwd(b[3], b[0], b[1], b[2], out, lse, SCALE, mask, impl=impl)
        assert rel(out, out_r) < 2e-2 and rel(dq, gq) < 3e-2 and rel(dk, gk) < 3e-2
        assert rel(dv, gv) < 3e-2


# ---- LoRA linear ----


def frozen(w: Tensor, quant: QuantSpec | None) -> FrozenWeight:
    fw = FrozenWeight(*w.shape, w.dtype)
    fw.set_dense(w, quant)
    assert fw.quant == quant  # really packed (a ragged input size would stay dense)
    return fw


@pytest.mark.parametrize("quant", [None, QuantSpec(4, 32)], ids=["dense", "q4g32"])
@pytest.mark.parametrize("store_h", [False, True])
def test_lora_linear_backward(quant: QuantSpec | None, store_h: bool) -> None:
    n_in, n_out, r, s = 64, 40, 3, 2.0
    base = frozen(randn(n_out, n_in, seed=20) * 0.1, quant)
    bias, A, Bm = randn(n_out, seed=21), randn(r, n_in, seed=22), randn(n_out, r, seed=23)
    x, dy = randn(2, 5, n_in, seed=24), randn(2, 5, n_out, seed=25)
    xr, Ar, Br = (t.clone().requires_grad_() for t in (x, A, Bm))
    y = F.linear(xr, base.dense(F64), bias) + s * F.linear(F.linear(xr, Ar), Br)
    gx, gA, gB = torch.autograd.grad(y, (xr, Ar, Br), dy)
    y2, h = lora_linear_with_h(x, base, bias, A, Bm, s)
    assert rel(y2, y.detach()) < TOL and rel(lora_linear(x, base, bias, A, Bm, s), y2) < TOL
    gA0, gB0 = randn(r, n_in, seed=26), randn(n_out, r, seed=27)  # accumulates onto these
    gA_acc, gB_acc = gA0.clone(), gB0.clone()
    dx = lora_linear_backward(dy, x, base, A, Bm, s, gA_acc, gB_acc, h=h if store_h else None)
    assert dx is not None and dx.shape == x.shape
    assert rel(dx, gx) < TOL and rel(gA_acc - gA0, gA) < TOL and rel(gB_acc - gB0, gB) < TOL
    none = lora_linear_backward(dy, x, base, A, Bm, s, gA_acc, gB_acc, need_dx=False)
    assert none is None and rel(gA_acc - gA0, 2 * gA) < TOL


def test_lora_linear_bf16_activations_fp32_grads() -> None:
    base = frozen(randn(40, 64, seed=30).bfloat16(), QuantSpec(4, 32))
    A, Bm = randn(3, 64, seed=31).float(), randn(40, 3, seed=32).float()
    x, dy = randn(4, 64, seed=33).bfloat16(), randn(4, 40, seed=34).bfloat16()
    gA, gB = torch.zeros_like(A), torch.zeros_like(Bm)
    dx = lora_linear_backward(dy, x, base, A, Bm, 0.5, gA, gB)
    assert dx is not None and dx.dtype == torch.bfloat16 and gA.dtype == torch.float32
    assert rel(gB, 0.5 * dy.float().t() @ (x.float() @ A.t())) < 1e-6


# ---- chunked cross-entropy ----

N, DIM, V = 37, 64, 103


def ce_case(softcap: float | None, quant: QuantSpec | None, dtype: torch.dtype = F64):
    head = frozen(randn(V, DIM, seed=40, dtype=dtype), quant)
    h = randn(N, DIM, seed=41, dtype=dtype) * 0.5
    targets = torch.randint(0, V, (N,), generator=gen(42))
    mask = torch.rand(N, generator=gen(43)) > 0.3
    targets[~mask] = -100  # never read: untrained rows are skipped, not clamped
    return h, targets, mask, head


def ce_ref(h, targets, mask, head, softcap, normalizer=None):
    hr = h.double().clone().requires_grad_()
    z = hr @ head.dense(F64).t()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z[mask], targets[mask], reduction="sum")
    n = int(mask.sum())
    (dh,) = torch.autograd.grad(loss / (normalizer or n), hr)
    return loss.detach(), n, dh


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap3"])
@pytest.mark.parametrize("quant", [None, QuantSpec(4, 32)], ids=["dense", "q4g32"])
@pytest.mark.parametrize("vocab_chunk", [None, 25], ids=["wholeV", "V25"])
def test_chunked_ce(softcap: float | None, quant: QuantSpec | None, vocab_chunk: int | None):
    h, targets, mask, head = ce_case(softcap, quant)
    loss_r, n_r, dh_r = ce_ref(h, targets, mask, head, softcap)
    loss, n, dh = chunked_ce_loss_and_grad(
        h, targets, mask, head, softcap, chunk_rows=8, vocab_chunk=vocab_chunk
    )
    assert n == n_r and 0 < n < N and dh.shape == h.shape and dh.dtype == h.dtype
    assert rel(loss, loss_r) < TOL and rel(dh, dh_r) < TOL
    assert bool((dh[~mask] == 0).all())
    loss_eval, n_eval = chunked_ce_loss(h, targets, mask, head, softcap, 8, vocab_chunk)
    assert n_eval == n and rel(loss_eval, loss_r) < TOL


def test_chunked_ce_normalizer_and_batch_dims() -> None:
    h, targets, mask, head = ce_case(3.0, None)
    _, _, dh_r = ce_ref(h, targets, mask, head, 3.0, normalizer=100)
    shape = (1, N)
    loss, n, dh = chunked_ce_loss_and_grad(
        h.view(*shape, DIM), targets.view(shape), mask.view(shape), head, 3.0,
        chunk_rows=5, vocab_chunk=40, normalizer=100,
    )  # fmt: skip
    assert dh.shape == (*shape, DIM) and rel(dh.view(N, DIM), dh_r) < TOL


@pytest.mark.parametrize("vocab_chunk", [None, 25])
def test_chunked_ce_no_trained_rows(vocab_chunk: int | None) -> None:
    h, targets, _, head = ce_case(None, None)
    mask = torch.zeros(N, dtype=torch.bool)
    loss, n, dh = chunked_ce_loss_and_grad(h, targets, mask, head, None, vocab_chunk=vocab_chunk)
    assert n == 0 and float(loss) == 0.0 and bool((dh == 0).all())
    assert not bool(torch.isnan(loss)) and chunked_ce_loss(h, targets, mask, head, None)[1] == 0


def test_chunked_ce_bf16() -> None:
    """bf16 states and head: fp32 loss, bf16 dh, close to the fp64 reference at bf16 precision."""
    h, targets, mask, head = ce_case(3.0, QuantSpec(4, 32), torch.bfloat16)
    loss_r, _, dh_r = ce_ref(h, targets, mask, head, 3.0)
    for vc in (None, 25):
        loss, _, dh = chunked_ce_loss_and_grad(h, targets, mask, head, 3.0, 8, vc)
        assert loss.dtype == torch.float64 and dh.dtype == torch.bfloat16
        assert rel(loss, loss_r) < 1e-2 and rel(dh, dh_r) < 2e-2
