"""Loss-head options on every engine: logits masking on/off gives the same gradients, and the
sampled softmax (`--loss sampled-softmax`) computes the same approximate objective in every
engine, hand-derived (mesp) or autograd (bp, mebp), exactly as its definition says."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mesp.engines import make_engine
from mesp.engines.loss import LossSpec
from mesp.errors import MespError
from mesp.ops.cross_entropy import CEOptions, chunked_ce_loss, chunked_ce_loss_and_grad
from mesp.ops.sampled_softmax import PROBES, choose_subset
from mesp.quant import QuantSpec
from tests.engine_cases import assert_grads_match, grads_of, model_with_adapter, padded_batch

SAMPLED = LossSpec("sampled-softmax", vocab_subset=40, seed=3)


@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp"])
def test_logits_masking_changes_nothing_but_cost(engine: str) -> None:
    model = model_with_adapter("qwen2")
    batch = padded_batch()
    on = grads_of(make_engine(engine, loss=LossSpec(mask_logits=True)), model, batch)
    off = grads_of(make_engine(engine, loss=LossSpec(mask_logits=False)), model, batch)
    assert on[0] == pytest.approx(off[0], rel=1e-6)
    assert_grads_match(on[1], off[1])


def test_mezo_loss_options() -> None:
    """MeZO differentiates nothing; its forward loss honours the same options."""
    model, batch = model_with_adapter("gemma3"), padded_batch()
    ref = make_engine("bp").step(model, batch, batch.n_tokens)
    sampled = make_engine("bp", loss=SAMPLED).step(model, batch, batch.n_tokens)
    for spec, want in [(LossSpec(mask_logits=False), ref), (SAMPLED, sampled)]:
        got = make_engine("mezo", loss=spec).loss_sum(model, batch)
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("quant", [None, QuantSpec(4, 32)], ids=["dense", "q4"])
@pytest.mark.parametrize(
    "family, over",
    [("qwen2", {}), ("llama", {}), ("gemma3", {"final_logit_softcapping": 3.0})],
    ids=["tied", "untied", "softcap"],
)
def test_sampled_softmax_same_in_every_engine(family: str, over: dict, quant) -> None:  # type: ignore[no-untyped-def]
    model = model_with_adapter(family, quant, **over)
    batch = padded_batch()
    ref_loss, ref = grads_of(make_engine("bp", loss=SAMPLED), model, batch)
    for name, opts in [("mebp", {}), ("mesp", {}), ("mesp", {"chunk_rows": 7})]:
        loss, g = grads_of(make_engine(name, loss=SAMPLED, **opts), model, batch)
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert_grads_match(ref, g)
    exact_loss, exact = grads_of(make_engine("bp"), model, batch)
    assert abs(ref_loss / exact_loss - 1) < 0.2  # an estimate of the same loss
    a = torch.cat([t.flatten() for t in exact.values()])
    b = torch.cat([ref[k].flatten() for k in exact])
    assert F.cosine_similarity(a, b, dim=0) > 0.5  # an approximation, not noise


def _states(n: int = 50, d: int = 16, vocab: int = 97, dtype=torch.float64):  # type: ignore[no-untyped-def]
    from mesp.models.linear import FrozenWeight

    g = torch.Generator().manual_seed(0)
    head = FrozenWeight(vocab, d, dtype)
    head.set_dense(torch.randn(vocab, d, generator=g, dtype=dtype))
    h = torch.randn(n, d, generator=g, dtype=dtype)
    tgt = torch.randint(0, vocab, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.3
    return h, tgt, mask, head


@pytest.mark.parametrize("cap", [None, 2.5])
def test_sampled_op_gradient_is_the_subset_softmax_float64(cap: float | None) -> None:
    """dh from the hand-written chunked op equals float64 autograd of the definition:
    Σ_trained [logsumexp_{v∈S} z_v − z_target], z = cap·tanh(hWᵀ/cap), S from choose_subset."""
    h, tgt, mask, head = _states()
    opts = CEOptions(chunk_rows=8, vocab_subset=20, seed=4)
    loss, n, dh = chunked_ce_loss_and_grad(h, tgt, mask, head, cap, normalizer=7.0, opts=opts)
    subset, bias = choose_subset(h[mask], tgt[mask], head, 20, seed=4)
    hr = h.clone().requires_grad_()
    z = hr @ head.weight[subset].t()
    z = (torch.tanh(z / cap) * cap if cap else z) + bias.double()
    local = torch.searchsorted(subset, tgt)
    ref = F.cross_entropy(z[mask], local[mask], reduction="sum")
    (ref / 7.0).backward()
    assert n == int(mask.sum())
    assert abs(float(loss) - ref.item()) <= 1e-12 * abs(ref.item())
    assert hr.grad is not None
    assert (dh - hr.grad).abs().max() <= 1e-10 * hr.grad.abs().max()


def test_subset_holds_targets_is_deterministic_and_ranks_by_the_head() -> None:
    h, tgt, mask, head = _states(n=200)
    a, ba = choose_subset(h, tgt, head, 10, seed=1, vocab_chunk=13)
    b, bb = choose_subset(h, tgt, head, 10, seed=1)
    assert torch.equal(a, b) and torch.equal(ba, bb)  # slicing the head changes nothing
    assert torch.equal(a, torch.sort(a).values)
    targets = set(tgt.tolist())
    assert targets <= set(a.tolist()) and len(a) == len(targets) + 10
    # 5 drawn tokens, each standing for R/5 of the R = V - |targets| - 5 others
    rest = 97 - len(targets) - 5
    assert sorted(ba.tolist()).count(0.0) == len(targets) + 5
    assert ba.max().item() == pytest.approx(math.log(rest / 5))
    # with every row a probe (n <= PROBES), the hard half is the top-5 of max-over-rows logits
    hs, ts = h[:PROBES], tgt[:PROBES]
    c, bc = choose_subset(hs, ts, head, 10)
    score = (hs @ head.weight.t()).amax(0)
    score[ts.unique()] = -torch.inf
    hard = {int(v) for v, w in zip(c, bc, strict=True) if w == 0} - set(ts.tolist())
    assert hard == set(torch.topk(score, 5).indices.tolist())
    other_seed = choose_subset(hs, ts, head, 10, seed=2)[0]
    assert not torch.equal(c, other_seed)  # the draws follow the seed


def test_subset_covering_the_vocabulary_is_exact_ce() -> None:
    h, tgt, mask, head = _states()
    exact, _ = chunked_ce_loss(h, tgt, mask, head, None)
    full, _ = chunked_ce_loss(h, tgt, mask, head, None, opts=CEOptions(vocab_subset=96))
    assert float(full) == pytest.approx(float(exact), rel=1e-12)


def test_bad_subset_sizes() -> None:
    model = model_with_adapter("llama")
    with pytest.raises(MespError, match="not smaller than the vocabulary"):
        make_engine("mesp", loss=LossSpec("sampled-softmax", 211)).step(model, padded_batch(), 10)
    with pytest.raises(MespError, match="positive integer"):
        LossSpec("sampled-softmax", 0)
    with pytest.raises(MespError, match="--loss must be one of"):
        LossSpec("hinge")


@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp"])
def test_no_trained_tokens_is_a_zero_loss_not_nan(engine: str) -> None:
    model, batch = model_with_adapter("qwen3"), padded_batch()
    batch.mask[:] = False  # (inside a group that has trained tokens elsewhere: normalizer 5)
    loss = make_engine(engine, loss=SAMPLED).step(model, batch, 5)
    grads = [p.grad for p in model.lora_parameters()]
    assert loss == 0.0 and all(g is None or float(g.abs().max()) == 0.0 for g in grads)
