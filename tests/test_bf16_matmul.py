"""bf16 where the CPU has no bf16 GEMM: every matmul of the product computes in fp32 and rounds
once (mesp/ops/matmul.py), the engines keep their exactness relations in bf16, and the path
that runs on such a CPU is that one (no bf16 GEMM or bf16 flash kernel is ever called)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mesp.engines import make_engine
from mesp.errors import MespError
from mesp.ops import matmul as mm
from mesp.ops.attention import attention, attention_bwd, attention_fwd
from mesp.quant import QuantSpec
from tests.engine_cases import grads_of, model_with_adapter, padded_batch
from tests.hf_tiny import FAMILIES, LATER

BF16 = torch.bfloat16
_aten = torch.ops.aten
KERNELS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.addmm_.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


class KernelDtypes(TorchDispatchMode):
    """Records the dtypes of the tensors each GEMM / flash-attention call receives."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in KERNELS:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            dts = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
            self.seen.append((func.__name__, dts))
        return func(*args, **kwargs)


def _r(*shape: int, seed: int = 0, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def fp32_mode(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(mm.ENV, "fp32")


def test_auto_picks_fp32_exactly_where_the_cpu_lacks_the_kernel(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(mm.ENV, raising=False)
    x = _r(2, 3)
    assert mm.computes_in_fp32(x) == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert mm.computes_in_fp32(x.to("meta")) == mm.computes_in_fp32(x)  # meta stands for the CPU
    assert not mm.computes_in_fp32(x.float()) and not mm.computes_in_fp32(x.double())
    monkeypatch.setenv(mm.ENV, "native")
    assert not mm.computes_in_fp32(x)
    monkeypatch.setenv(mm.ENV, "fp32")
    assert mm.computes_in_fp32(x) and mm.computes_in_fp32(x.half())
    monkeypatch.setenv(mm.ENV, "fast")
    with pytest.raises(MespError, match=mm.ENV):
        mm.computes_in_fp32(x)


@pytest.mark.skipif(
    torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has a native bf16 GEMM"
)
@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp", "mezo"])
def test_on_this_cpu_no_bf16_kernel_runs(engine: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The default (auto) on a CPU without bf16 GEMM: a bf16 training step, a forward with a
    KV cache and the loss never hand a bf16 tensor to a GEMM or to the flash kernels."""
    monkeypatch.delenv(mm.ENV, raising=False)
    from mesp.models.transformer import KVCache

    model = model_with_adapter("gemma3", QuantSpec(4, 32), dtype=BF16)
    batch = padded_batch()
    spy = KernelDtypes()
    with spy:
        make_engine(engine).step(model, batch, batch.n_tokens)
        with torch.no_grad():
            n = len(model.layers)
            cache = KVCache(k=[None] * n, v=[None] * n)
            model(batch.input_ids[:1, :5], cache)
            model(batch.input_ids[:1, 5:6], cache, start=5)
    assert spy.seen, "no kernel recorded"
    bad = [(f, d) for f, d in spy.seen if BF16 in d]
    assert not bad, bad[:5]


@pytest.mark.usefixtures("fp32_mode")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_helpers_equal_upcast_matmul_round(dtype: torch.dtype) -> None:
    """One block: bit for bit the fp32 product rounded once, as a native GEMM computes it."""
    x, w, b = _r(3, 7, 64, seed=1, dtype=dtype), _r(40, 64, seed=2, dtype=dtype), _r(40, seed=3)
    b = b.to(dtype)
    up = F.linear(x.float(), w.float(), b.float()).to(dtype)
    assert torch.equal(mm.linear(x, w, b), up)
    assert torch.equal(mm.linear(x, w), F.linear(x.float(), w.float()).to(dtype))
    dy = _r(21, 40, seed=4, dtype=dtype)
    assert torch.equal(mm.matmul(dy, w), (dy.float() @ w.float()).to(dtype))
    acc = _r(40, 64, seed=5, dtype=dtype)
    ref = torch.addmm(acc.float(), dy.float().t(), x.reshape(21, 64).float(), alpha=0.5)
    mm.addmm_(acc, dy.t(), x.reshape(21, 64), alpha=0.5)
    assert torch.equal(acc, ref.to(dtype))


@pytest.mark.usefixtures("fp32_mode")
@pytest.mark.parametrize("case", ["wide", "wide-bias", "long", "long-addmm"])
def test_blocked_upcast_matches_one_fp32_product(case: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A large operand is upcast in blocks (here forced by a tiny BLOCK_BYTES): column blocks
    are the same dot products; k blocks sum partial fp32 products, so within a rounding."""
    monkeypatch.setattr(mm, "BLOCK_BYTES", 4 * 64 * 100)
    if case.startswith("wide"):
        x, w = _r(50, 64, seed=6), _r(1000, 64, seed=7)
        b = _r(1000, seed=8) if case == "wide-bias" else None
        got = mm.linear(x, w, b)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(BF16)
        assert torch.equal(got, ref)
        return
    a, w = _r(30, 5000, seed=9), _r(5000, 40, seed=10)
    if case == "long":
        got, ref32 = mm.matmul(a, w), a.float() @ w.float()
    else:
        got = _r(30, 40, seed=11)
        ref32 = torch.addmm(got.float(), a.float(), w.float(), alpha=0.5)
        mm.addmm_(got, a, w, alpha=0.5)
    assert (got.float() - ref32).abs().max() <= 2**-7 * ref32.abs().max()


@pytest.mark.usefixtures("fp32_mode")
def test_autograd_linear_saves_low_precision_and_rounds_each_gradient_once() -> None:
    x, A = _r(4, 5, 16, seed=12).requires_grad_(), _r(3, 16, seed=13).requires_grad_()
    dy = _r(4, 5, 3, seed=14)
    y = mm.linear(x, A)
    assert y.dtype == BF16 and y.grad_fn is not None
    y.backward(dy)
    x32, A32 = (t.detach().float().requires_grad_() for t in (x, A))
    F.linear(x32, A32).backward(dy.float())
    assert x.grad is not None and A.grad is not None and x32.grad is not None
    assert torch.equal(x.grad, x32.grad.to(BF16)) and torch.equal(A.grad, A32.grad.to(BF16))


@pytest.mark.usefixtures("fp32_mode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_product_records_what_it_computes_in_place(dtype: torch.dtype) -> None:
    """y + alpha·a b: in place without autograd, the same bits under it (torch's addmm in
    fp32; the fp32 GEMM, rounded once, for bf16), and addmm's gradients: dc = dy,
    da = alpha·dy bᵀ, db = alpha·aᵀ dy (each product rounded once, then scaled)."""
    y0, a, b = (
        _r(12, 40, seed=30, dtype=dtype),
        _r(12, 8, seed=31, dtype=dtype),
        _r(8, 40, seed=32, dtype=dtype),
    )
    ref = torch.addmm(y0.float(), a.float(), b.float(), alpha=0.7)
    y = y0.clone()
    with torch.no_grad():
        out = mm.add_product(y, a, b, 0.7)
    assert out.data_ptr() == y.data_ptr()  # in place: no fresh (n, m) result
    assert torch.equal(out, ref.to(dtype))
    y3 = y0.clone().view(3, 4, 40)  # leading dimensions: flattened for the GEMM, restored
    with torch.no_grad():
        out3 = mm.add_product(y3, a.view(3, 4, 8), b, 0.7)
    assert out3.shape == (3, 4, 40) and out3.data_ptr() == y3.data_ptr()
    assert torch.equal(out3.view(12, 40), out)
    yg, ag, bg = (t.clone().requires_grad_() for t in (y0, a, b))
    rec = mm.add_product(yg, ag, bg, 0.7)
    assert torch.equal(rec, out) and rec is not yg
    dy = _r(12, 40, seed=33, dtype=dtype)
    rec.backward(dy)
    assert torch.equal(yg.grad, dy)
    d32 = dy.float()
    da, db = (d32 @ b.float().t()).to(dtype) * 0.7, (a.float().t() @ d32).to(dtype) * 0.7
    assert torch.equal(ag.grad, da) and torch.equal(bg.grad, db)


@pytest.mark.usefixtures("fp32_mode")
def test_attention_in_fp32_is_the_upcast_flash_call_and_its_autograd_is_attention_bwd() -> None:
    q, k, v = _r(1, 4, 9, 8, seed=15), _r(1, 2, 9, 8, seed=16), _r(1, 2, 9, 8, seed=17)
    out32, _ = attention_fwd(q.float(), k.float(), v.float(), 0.3, None)
    out, lse = attention_fwd(q, k, v, 0.3, None)
    assert out.dtype == BF16 and torch.equal(out, out32.to(BF16))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    y = attention(qg, kg, vg, 0.3, None)
    assert torch.equal(y, out)
    dout = _r(1, 4, 9, 8, seed=18)
    y.backward(dout)
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, 0.3, None)
    assert torch.equal(qg.grad, dq) and torch.equal(kg.grad, dk) and torch.equal(vg.grad, dv)


# ---- the engines' exactness relations, in bf16 on the fp32-compute path ----


@pytest.mark.usefixtures("fp32_mode")
@pytest.mark.parametrize(  # the later families' 4-bit cases in the slow suite (time)
    "family,quant",
    [
        pytest.param(f, q, id=f"{f}-{qid}", marks=pytest.mark.slow if f in LATER and q else ())
        for f in FAMILIES
        for q, qid in ((None, "dense"), (QuantSpec(4, 32), "q4"))
    ],
)
def test_bf16_mebp_bit_identical_and_mesp_close_to_bp(family: str, quant: QuantSpec | None) -> None:
    """mebp recomputes bp's ops: the same bits. mesp's hand backward rounds in another order,
    so bf16 rounding apart (measured: cosine >= 0.99995, max rel. error <= 0.016)."""
    model = model_with_adapter(family, quant, dtype=BF16)
    batch = padded_batch()
    loss_bp, g_bp = grads_of(make_engine("bp"), model, batch)
    loss_me, g_me = grads_of(make_engine("mebp"), model, batch)
    loss_ms, g_ms = grads_of(make_engine("mesp"), model, batch)
    assert loss_bp == loss_me and all(torch.equal(g_bp[k], g_me[k]) for k in g_bp)
    assert all(g.dtype == BF16 for g in g_ms.values()) and g_ms.keys() == g_bp.keys()
    assert abs(loss_bp - loss_ms) <= 1e-5 * abs(loss_bp)
    a = torch.cat([t.flatten().double() for t in g_bp.values()])
    b = torch.cat([g_ms[k].flatten().double() for k in g_bp])
    assert F.cosine_similarity(a, b, dim=0) >= 0.9999
    for k in g_bp:
        rel = (g_ms[k].double() - g_bp[k].double()).abs().max() / g_bp[k].double().abs().max()
        assert rel <= 0.04, (k, rel)


@pytest.mark.usefixtures("fp32_mode")
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_bf16_kept_tapes_give_plain_mesps_bits(family: str) -> None:
    from tests.test_engine_mesp_kept import assert_same_bits, three_blocks

    model = three_blocks(family, QuantSpec(4, 32), dtype=BF16)
    assert all(p.dtype == BF16 for p in model.lora_parameters())
    assert_same_bits(model, padded_batch(), keeps=(1, 3))
