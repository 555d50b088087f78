"""MeZO: in-place SPSA probes restore θ, the projected gradient is the directional derivative,
the update is θ − lr·g·z with z regenerated from the seed, and n-SPSA averages n probes."""

from __future__ import annotations

import math

import pytest
import torch

from mesp.engines import make_engine
from mesp.engines.mezo import MeZOEngine, perturbed_tensors
from mesp.errors import MespError
from mesp.quant import QuantSpec
from tests.engine_cases import grads_of, model_with_adapter, padded_batch


def _params(model) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_projected_gradient_is_directional_derivative(family: str) -> None:
    model = model_with_adapter(family, dtype=torch.float64)
    batch = padded_batch()
    _, exact = grads_of(make_engine("bp"), model, batch)
    zo = MeZOEngine(eps=1e-5)
    before = _params(model)
    g, plus, minus = zo.probe(model, batch, batch.n_tokens, seed=123)
    after = _params(model)
    for k in before:  # +ε, −2ε, +ε: back where it started, to rounding
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=1e-15)
    dd = sum(float((exact[n] * z).sum()) for n, _, z in zo.directions(model, 123))
    assert g == pytest.approx(dd, rel=1e-6)
    loss = make_engine("bp").step(model, batch, batch.n_tokens)
    assert (plus + minus) / 2 == pytest.approx(loss, rel=1e-6)  # bp sums in fp32


def test_step_updates_in_place_from_the_seed() -> None:
    model = model_with_adapter("llama")
    batch = padded_batch()
    zo = make_engine("mezo", lr=1e-3, eps=1e-3, seed=7, weight_decay=0.1)
    assert zo.name == "mezo" and zo.updates_params
    before = _params(model)
    loss = zo.step(model, batch, batch.n_tokens)
    [(g, seed)] = zo.projected_grad_and_seed()
    expect = {
        n: before[n] * (1 - 1e-3 * 0.1) - 1e-3 * g * z for n, _, z in zo.directions(model, seed)
    }
    for n, p in _params(model).items():
        torch.testing.assert_close(p, expect[n], rtol=0, atol=1e-6)
    assert all(p.grad is None for p in model.lora_parameters())  # nothing stored
    assert loss == pytest.approx(make_engine("bp").step(model, batch, batch.n_tokens), rel=1e-3)


def test_set_lr_scales_the_update() -> None:
    batch = padded_batch()
    deltas = []
    for lr in (1e-3, 2e-3):
        model = model_with_adapter("qwen3", dtype=torch.float64)
        before = _params(model)
        zo = MeZOEngine(seed=3)
        zo.set_lr(lr)
        zo.step(model, batch, batch.n_tokens)
        deltas.append(torch.cat([(p - before[n]).flatten() for n, p in _params(model).items()]))
    torch.testing.assert_close(deltas[1], 2 * deltas[0], rtol=1e-9, atol=1e-15)


def test_n_spsa_estimate_is_the_mean_of_probes_and_leaves_theta() -> None:
    model = model_with_adapter("qwen2", dtype=torch.float64)
    batch = padded_batch()
    zo = MeZOEngine(eps=1e-4, samples=4)
    before = _params(model)
    est = zo.estimate(model, batch, batch.n_tokens, seed=5)
    for n, p in _params(model).items():
        torch.testing.assert_close(p, before[n], rtol=0, atol=1e-12)
    seeds = torch.Generator().manual_seed(5)
    manual = {n: torch.zeros_like(p) for n, p in before.items()}
    for _ in range(4):
        s = int(torch.randint(0, 2**62, (), generator=seeds))
        g, _, _ = zo.probe(model, batch, batch.n_tokens, s)
        for n, _, z in zo.directions(model, s):
            manual[n] += g * z / 4
    for n in est:
        torch.testing.assert_close(est[n].double(), manual[n], rtol=1e-5, atol=1e-9)
    again = zo.estimate(model, batch, batch.n_tokens, seed=5)  # θ moved only by rounding
    for n in est:
        torch.testing.assert_close(again[n], est[n], rtol=1e-6, atol=1e-10)


def test_more_samples_align_better_with_the_exact_gradient() -> None:
    model = model_with_adapter("llama", dtype=torch.float64)
    batch = padded_batch()
    _, exact = grads_of(make_engine("mesp"), model, batch)
    flat = torch.cat([exact[n].flatten() for n, _ in perturbed_tensors(model, False)])
    zo = MeZOEngine(eps=1e-4)

    def cos(est: dict[str, torch.Tensor]) -> float:
        e = torch.cat([est[n].double().flatten() for n, _ in perturbed_tensors(model, False)])
        return float(e @ flat / (e.norm() * flat.norm()))

    # d ≈ 6.6k: E|cos| ≈ √(2/(πd)) ≈ 0.01 for one sample, ≈ √(64/d) ≈ 0.1 for 64
    one = [abs(cos(zo.estimate(model, batch, batch.n_tokens, seed=s, samples=1))) for s in range(4)]
    many = cos(zo.estimate(model, batch, batch.n_tokens, seed=0, samples=64))
    assert many > 3 * sum(one) / 4 and many > 0.05


def test_perturb_all_needs_a_dense_base_and_restores_buffers() -> None:
    q = model_with_adapter("qwen2", quant=QuantSpec(4, 32))
    with pytest.raises(MespError, match="unquantized"):
        MeZOEngine(perturb_all=True).probe(q, padded_batch(), 10, seed=1)
    model = model_with_adapter("qwen2", dtype=torch.float64)
    named = perturbed_tensors(model, perturb_all=True)
    assert any(n.endswith("embed_tokens.weight") for n, _ in named)
    assert any(n.endswith("norm.weight") for n, _ in named)
    before = {n: t.clone() for n, t in named}
    MeZOEngine(perturb_all=True, eps=1e-3).probe(model, padded_batch(), 10, seed=1)
    for n, t in perturbed_tensors(model, perturb_all=True):
        torch.testing.assert_close(t, before[n], rtol=0, atol=1e-14)


def test_bad_options_rejected() -> None:
    with pytest.raises(MespError, match="samples"):
        MeZOEngine(samples=0)
    with pytest.raises(MespError, match="eps"):
        MeZOEngine(eps=0.0)


def test_non_finite_loss_leaves_theta() -> None:
    model = model_with_adapter("qwen2")
    poisoned = model.lora_parameters()[-1]
    with torch.no_grad():
        poisoned[0, 0] = float("inf")
    before = _params(model)
    loss = MeZOEngine(lr=1.0).step(model, padded_batch(), 10)
    assert not math.isfinite(loss)
    after = _params(model)
    for n in before:  # probed and restored (to rounding), never updated with a NaN step
        a, b = torch.nan_to_num(after[n]), torch.nan_to_num(before[n])
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_trains_through_the_trainer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from mesp.batch import Example
    from mesp.lora import LoraConfig
    from mesp.training import TrainConfig, train

    model = model_with_adapter("llama")
    g = torch.Generator().manual_seed(0)
    rows = [Example(torch.randint(0, 211, (16,), generator=g).tolist(), [0] + [1] * 15)] * 4
    before = _params(model)
    cfg = TrainConfig(steps=2, batch_size=2, eval_every=0, save_every=0, progress=False)
    res = train(model, make_engine("mezo", lr=1e-2), rows, rows, cfg, LoraConfig(rank=3), tmp_path)
    assert len(res.train_losses) == 2 and all(math.isfinite(x) for x in res.train_losses)
    assert any(not torch.equal(p, before[n]) for n, p in _params(model).items())


def test_seed_stream_resumes() -> None:
    a = MeZOEngine(seed=9)
    a.next_seed()
    state = a.state_dict()
    want = [a.next_seed() for _ in range(3)]
    b = MeZOEngine(seed=0)
    b.load_state_dict(state)
    assert [b.next_seed() for _ in range(3)] == want
