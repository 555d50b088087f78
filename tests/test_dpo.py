"""Preference objectives are exact: bp's DPO / ORPO gradients equal a hand-written autograd
loss over full logits (and over HF + PEFT, adapter disabled for the reference); mebp's and
mesp's equal bp's. Pairs are rows (2i, 2i+1) of the batch: (chosen, rejected)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mesp.batch import Batch
from mesp.engines import make_engine
from mesp.engines.loss import LossSpec
from mesp.engines.objective import (
    LOSS_TYPES,
    SMOOTHED,
    Objective,
    PreferenceEngine,
    adapters_off,
    pair_terms,
)
from mesp.errors import MespError
from mesp.ops.cross_entropy import CEOptions, chunked_ce_row_losses
from tests.engine_cases import (
    DEVICE,
    assert_grads_match,
    model_with_adapter,
    padded_batch,
    with_saved_adapter,
)
from tests.hf_tiny import FAMILIES, hf_model

DPO, ORPO = Objective("dpo", beta=0.7), Objective("orpo", orpo_lambda=0.6)
# every DPO loss type; the smoothed ones with ε too
LOSS_CASES = [Objective("dpo", 0.7, loss_type=t) for t in LOSS_TYPES] + [
    Objective("dpo", 0.7, loss_type=t, label_smoothing=0.2) for t in SMOOTHED
]


def pair_batch() -> Batch:
    """Two pairs; rows of different lengths, a masked prompt of 4 tokens, right padding."""
    return padded_batch(b=4, s=17)


def logps(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(B,) summed log-probs of the masked targets, from full logits (B, S, V), in fp64 (as the
    engines sum them: the log-ratios of the losses cancel the sums' leading digits)."""
    lp = F.log_softmax(logits.double(), -1).gather(-1, batch.targets[..., None]).squeeze(-1)
    return (lp * batch.mask).sum(1)


def written_out_loss(obj: Objective, pol: torch.Tensor, ref: torch.Tensor, batch: Batch):  # type: ignore[no-untyped-def]
    """TRL's formulas (DPOTrainer.dpo_loss, ORPOTrainer.odds_ratio_loss), transcribed
    independently of mesp.engines.objective."""
    n = batch.mask.sum(1).float()
    if obj.kind == "dpo":
        if obj.loss_type == "ipo":  # concatenated_forward: all_logps / loss_mask.sum(-1)
            pol, ref = pol / n, ref / n
        return trl_dpo_losses(obj, pol[0::2], pol[1::2], ref[0::2], ref[1::2]).mean()
    c, r = pol[0::2], pol[1::2]
    mc, mr = c / n[0::2], r / n[1::2]
    log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
    nll = -c.sum() / n[0::2].sum()
    return nll - obj.orpo_lambda * F.logsigmoid(log_odds).mean()


def trl_dpo_losses(obj: Objective, chosen, rejected, ref_chosen, ref_rejected):  # type: ignore[no-untyped-def]
    beta, ls = obj.beta, obj.label_smoothing
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = {
        "sigmoid": lambda: (
            -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        ),
        "robust": lambda: (
            (-F.logsigmoid(beta * logits) * (1 - ls) + F.logsigmoid(-beta * logits) * ls)
            / (1 - 2 * ls)
        ),
        "exo_pair": lambda: (
            (beta * logits).sigmoid() * (F.logsigmoid(beta * logits) - math.log(1 - (ls or 1e-3)))
            + (-beta * logits).sigmoid() * (F.logsigmoid(-beta * logits) - math.log(ls or 1e-3))
        ),
        "hinge": lambda: torch.relu(1 - beta * logits),
        "ipo": lambda: (logits - 1 / (2 * beta)) ** 2,
        "nca_pair": lambda: (
            -F.logsigmoid(chosen_logratios * beta)
            - 0.5 * F.logsigmoid(-chosen_logratios * beta)
            - 0.5 * F.logsigmoid(-rejected_logratios * beta)
        ),
        "sppo_hard": lambda: (
            (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        ),
        "apo_zero": lambda: (
            1 - F.sigmoid(beta * chosen_logratios) + F.sigmoid(beta * rejected_logratios)
        ),
        "apo_down": lambda: (
            F.sigmoid(beta * chosen_logratios)
            + 1
            - F.sigmoid(beta * (chosen_logratios - rejected_logratios))
        ),
    }
    return losses[obj.loss_type]()


def engine_grads(engine, model, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    for p in model.lora_parameters():
        p.grad = None
    loss = engine.step(model, batch, 1)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def reference_grads(model, batch: Batch, obj: Objective) -> tuple[float, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    for p in model.lora_parameters():
        p.grad = None
    with torch.no_grad(), adapters_off(model):
        ref = logps(model(batch.input_ids), batch)
    loss = written_out_loss(obj, logps(model(batch.input_ids), batch), ref, batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("obj", [DPO, ORPO], ids=["dpo", "orpo"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bp_equals_written_out_loss(family: str, obj: Objective) -> None:
    model, batch = model_with_adapter(family), pair_batch()
    loss_ref, g_ref = reference_grads(model, batch, obj)
    loss_bp, g_bp = engine_grads(PreferenceEngine(make_engine("bp"), obj), model, batch)
    assert loss_bp == pytest.approx(loss_ref, rel=1e-5)
    assert_grads_match(g_ref, g_bp)
    assert all(torch.count_nonzero(g) > 0 for g in g_bp.values())


@pytest.mark.parametrize("obj", [DPO, ORPO], ids=["dpo", "orpo"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mesp_and_mebp_equal_bp(family: str, obj: Objective) -> None:
    model, batch = model_with_adapter(family), pair_batch()
    loss_bp, g_bp = engine_grads(PreferenceEngine(make_engine("bp"), obj), model, batch)
    unmasked = LossSpec(mask_logits=False)  # logits for every row: untrained ones weigh 0
    runs = [
        ("mebp", {}),
        ("mesp", {"chunk_rows": 7, "vocab_chunk": 64}),  # vocabulary slices (one-pass head)
        ("mesp", {"chunk_rows": None, "vocab_chunk": None}),  # the dense head
        ("mesp", {"chunk_rows": 5, "vocab_chunk": 64, "loss": unmasked}),
        ("bp", {"loss": unmasked}),
    ]
    for name, kw in runs:
        loss, g = engine_grads(PreferenceEngine(make_engine(name, **kw), obj), model, batch)
        assert loss == pytest.approx(loss_bp, rel=1e-6), name
        assert_grads_match(g_bp, g)


@pytest.mark.skipif(DEVICE != "cpu", reason="the HF oracle runs on the CPU")
@pytest.mark.parametrize("obj", [DPO, ORPO], ids=["dpo", "orpo"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bp_equals_hf_peft(family: str, obj: Objective, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The oracle of issue 30 item 5: the same written-out loss over HF + PEFT, the reference
    being PEFT's model with its adapter disabled."""
    from peft import PeftModel

    hf = hf_model(family)
    ours = with_saved_adapter(hf, tmp_path / "ad")
    peft = PeftModel.from_pretrained(hf, str(tmp_path / "ad"), is_trainable=True).eval()
    batch = pair_batch()
    with torch.no_grad(), peft.disable_adapter():
        ref = logps(peft(batch.input_ids).logits, batch)
    loss = written_out_loss(obj, logps(peft(batch.input_ids).logits, batch), ref, batch)
    loss.backward()
    g_hf = {
        n.removeprefix("base_model.model.").replace(".default.weight", ""): p.grad
        for n, p in peft.named_parameters()
        if p.requires_grad
    }
    loss_bp, g_bp = engine_grads(PreferenceEngine(make_engine("bp"), obj), ours, batch)
    assert loss_bp == pytest.approx(loss.item(), rel=1e-4)
    assert_grads_match(g_hf, g_bp)


def case_id(obj: Objective) -> str:
    return obj.loss_type + (f"-ls{obj.label_smoothing}" if obj.label_smoothing else "")


@pytest.mark.parametrize("obj", LOSS_CASES, ids=case_id)
def test_loss_types_exact(obj: Objective) -> None:
    """Each DPO loss type: bp equals the written-out TRL loss, mesp (vocabulary slices) and
    mebp equal bp."""
    model, batch = model_with_adapter("qwen2"), pair_batch()
    loss_ref, g_ref = reference_grads(model, batch, obj)
    loss_bp, g_bp = engine_grads(PreferenceEngine(make_engine("bp"), obj), model, batch)
    assert loss_bp == pytest.approx(loss_ref, rel=1e-5)
    assert_grads_match(g_ref, g_bp)
    assert all(torch.count_nonzero(g) > 0 for g in g_bp.values())
    for name, kw in (("mesp", {"chunk_rows": 7, "vocab_chunk": 64}), ("mebp", {})):
        loss, g = engine_grads(PreferenceEngine(make_engine(name, **kw), obj), model, batch)
        assert loss == pytest.approx(loss_bp, rel=1e-6), name
        assert_grads_match(g_bp, g)


def test_refusals() -> None:
    with pytest.raises(MespError, match="mezo"):
        PreferenceEngine(make_engine("mezo"), DPO)
    with pytest.raises(MespError, match="--objective"):
        Objective("kto")
    with pytest.raises(MespError, match="--loss-type must be one of sigmoid, robust"):
        Objective("dpo", loss_type="kto")
    with pytest.raises(MespError, match="DPO's"):
        Objective("orpo", loss_type="ipo")
    with pytest.raises(MespError, match=r"\[0, 0.5\)"):
        Objective("dpo", loss_type="robust", label_smoothing=0.5)
    with pytest.raises(MespError, match="applies to --loss-type sigmoid, robust, exo_pair"):
        Objective("dpo", loss_type="hinge", label_smoothing=0.1)
    model, batch = model_with_adapter("llama"), padded_batch(b=3)
    with pytest.raises(MespError, match="even"):
        PreferenceEngine(make_engine("bp"), DPO).step(model, batch, 1)


def test_adapters_off_is_the_base() -> None:
    model, batch = model_with_adapter("qwen2"), pair_batch()
    with torch.no_grad():
        with adapters_off(model):
            off = model(batch.input_ids)
        on = model(batch.input_ids)
        for m in model.lora_modules().values():
            m.remove_lora()
        base = model(batch.input_ids)
    assert torch.equal(off, base) and not torch.equal(on, base)


@pytest.mark.parametrize(
    "opts",
    [CEOptions(5, None), CEOptions(5, 64), CEOptions(5, 64, mask_logits=False)],
    ids=["dense", "sliced", "unmasked"],
)
@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: a logit softcap
def test_row_losses_are_each_tokens_cross_entropy(family: str, opts: CEOptions) -> None:
    model, batch = model_with_adapter(family), pair_batch()
    with torch.no_grad():
        hn = model.hidden(batch.input_ids)
        z = model.logits(hn).flatten(0, 1).float()
        want = F.cross_entropy(z, batch.targets.flatten(), reduction="none") * batch.mask.flatten()
        head, cap = model.head_weight(), model.config.final_logit_softcapping
        got = chunked_ce_row_losses(hn, batch.targets, batch.mask, head, cap, opts)
    # fp32 log-softmax of O(10) logits in another order: a few ulps of the largest loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert bool((got[~batch.mask.flatten()] == 0).all())


def test_sequence_derivatives_are_the_closed_forms() -> None:
    """dL/dlp per sequence, as the engines weight tokens by it: DPO −β·σ(−β·Δ)/P for the
    chosen row (opposite for the rejected); ORPO −1/N_c − λ/P·σ(−lo)/(n_c·(1 − e^m_c)) for the
    chosen row, +λ/P·σ(−lo)/(n_r·(1 − e^m_r)) for the rejected (m = lp/n, lo the log odds)."""
    lp = torch.tensor([-3.0, -5.0, -9.0, -4.0], dtype=torch.float64)
    ref = torch.tensor([-3.5, -4.0, -8.0, -4.5], dtype=torch.float64)
    n = torch.tensor([3.0, 4.0, 5.0, 2.0], dtype=torch.float64)
    c, r, p = slice(0, None, 2), slice(1, None, 2), 2

    def grad(obj: Objective) -> torch.Tensor:
        x = lp.clone().requires_grad_()
        loss, _ = pair_terms(obj, x, ref, n)
        return torch.autograd.grad(loss, x)[0]

    beta, lam = 0.3, 0.7
    s = torch.sigmoid(-beta * ((lp[c] - lp[r]) - (ref[c] - ref[r])))
    g = grad(Objective("dpo", beta=beta))
    torch.testing.assert_close(g[c], -beta * s / p, rtol=1e-12, atol=0)
    torch.testing.assert_close(g[r], beta * s / p, rtol=1e-12, atol=0)
    m = lp / n
    lo = (m[c] - m[r]) - (torch.log1p(-m[c].exp()) - torch.log1p(-m[r].exp()))
    sg = torch.sigmoid(-lo)
    g = grad(Objective("orpo", orpo_lambda=lam))
    want_c = -1 / n[c].sum() - lam / p * sg / (n[c] * (1 - m[c].exp()))
    torch.testing.assert_close(g[c], want_c, rtol=1e-12, atol=0)
    torch.testing.assert_close(g[r], lam / p * sg / (n[r] * (1 - m[r].exp())), rtol=1e-12, atol=0)
