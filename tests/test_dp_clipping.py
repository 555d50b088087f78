"""DP-SGD's clipped gradient sum (noise 0) against an independent per-example reference: HF +
PEFT autograd run on one row at a time, each row's loss its mean token cross-entropy, each
example's gradient clipped (per LoRA linear to C/√K, or flat to C) and the clipped gradients
summed. Every family, engines bp, mebp and mesp, both clippings; the bound is set between the
examples' norms so some are clipped and some are not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mesp.batch import Batch
from mesp.engines import make_engine
from mesp.engines.private import PrivateEngine
from mesp.models.transformer import CausalLM
from tests.engine_cases import padded_batch, with_saved_adapter
from tests.hf_tiny import FAMILIES, hf_model

REL = 1e-5  # the bar for the clipped sum


def example_grads(hf, ad: Path, batch: Batch) -> list[dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Per row: HF + PEFT's LoRA gradients of that row's mean trained-token cross-entropy, the
    row run alone, keyed by module path and lora_A / lora_B."""
    from peft import PeftModel

    peft = PeftModel.from_pretrained(hf, str(ad), is_trainable=True).train()
    out = []
    for e in range(batch.mask.shape[0]):
        peft.zero_grad(set_to_none=True)
        logits = peft(input_ids=batch.input_ids[e : e + 1]).logits[0]
        tgt = torch.where(batch.mask[e], batch.targets[e], -100)
        torch.nn.functional.cross_entropy(logits, tgt, reduction="mean").backward()
        grads = {}
        for n, p in peft.named_parameters():
            if "lora_" in n:
                grads[n.removeprefix("base_model.model.").replace(".default.weight", "")] = (
                    p.grad.detach().double().clone()
                )
        out.append(grads)
    return out


def modules(grads: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """module path -> its two keys (lora_A, lora_B)."""
    by: dict[str, list[str]] = {}
    for k in grads:
        by.setdefault(k.rsplit(".", 1)[0], []).append(k)
    return by


def norm(g: dict[str, torch.Tensor], keys: list[str]) -> float:
    return math.sqrt(sum(float(g[k].square().sum()) for k in keys))


def clipped_sum(per: list[dict[str, torch.Tensor]], clip: float, clipping: str) -> dict:  # type: ignore[type-arg]
    mods = modules(per[0])
    total = {k: torch.zeros_like(v) for k, v in per[0].items()}
    bound = clip / math.sqrt(len(mods))
    for g in per:
        if clipping == "flat":
            f = min(1.0, clip / max(norm(g, list(g)), 1e-300))
            for k in g:
                total[k] += f * g[k]
            continue
        for keys in mods.values():
            f = min(1.0, bound / max(norm(g, keys), 1e-300))
            for k in keys:
                total[k] += f * g[k]
    return total


def ours(model: CausalLM, engine: str, batch: Batch, clip: float, clipping: str) -> dict:  # type: ignore[type-arg]
    for p in model.lora_parameters():
        p.grad = None
    eng = PrivateEngine(make_engine(engine), clip, clipping)
    eng.step(model, batch, 0)
    return {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}


def assert_close(ref: dict, got: dict) -> None:  # type: ignore[type-arg]
    assert ref.keys() == got.keys()
    for k in ref:
        rel = (got[k] - ref[k]).abs().max() / ref[k].abs().max()
        assert rel <= REL, (k, float(rel))


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    hf = hf_model(request.param)
    ad = tmp_path_factory.mktemp(request.param) / "ad"
    model = with_saved_adapter(hf, ad)
    batch = padded_batch(b=4, s=23)
    per = example_grads(hf, ad, batch)
    return model, batch, per


@pytest.mark.parametrize("clipping", ["per-layer", "flat"])
@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp"])
def test_clipped_sum_equals_per_example_autograd(case, engine: str, clipping: str) -> None:  # type: ignore[no-untyped-def]
    model, batch, per = case
    # a bound between the examples' norms: some rows are clipped, some are not
    if clipping == "flat":
        norms = sorted(norm(g, list(g)) for g in per)
        clip = (norms[1] + norms[2]) / 2
    else:
        mods = modules(per[0])
        layer = sorted(norm(g, keys) for g in per for keys in mods.values())
        clip = layer[len(layer) // 2] * math.sqrt(len(mods))
    ref = clipped_sum(per, clip, clipping)
    assert_close(ref, ours(model, engine, batch, clip, clipping))
    unclipped = clipped_sum(per, 1e30, clipping)
    assert any((unclipped[k] - ref[k]).abs().max() > 1e-3 * ref[k].abs().max() for k in ref), (
        "the bound clipped nothing"
    )


@pytest.mark.parametrize("h_strategy,keep", [("recompute", 0), ("store", 1)])
def test_mesp_tiles_store_h_and_kept_tapes(tmp_path: Path, h_strategy: str, keep: int) -> None:
    """mesp's MLP in token tiles that cut across rows (each tile's tokens handed to the clipper
    with their offset), h stored, a kept tape: the same clipped sum as the reference."""
    hf = hf_model("llama")
    model = with_saved_adapter(hf, tmp_path / "ad")
    batch = padded_batch(b=4, s=23)
    per = example_grads(hf, tmp_path / "ad", batch)
    for block in model.layers:
        block.mlp.tile = 10  # 92 tokens: tiles of 10 start inside rows of 23
    for clipping in ("per-layer", "flat"):
        clip = sorted(norm(g, list(g)) for g in per)[2] / (1 if clipping == "flat" else 3)
        for p in model.lora_parameters():
            p.grad = None
        eng = PrivateEngine(
            make_engine("mesp", h_strategy=h_strategy, keep_tapes=keep), clip, clipping
        )
        eng.step(model, batch, 0)
        got = {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}
        assert_close(clipped_sum(per, clip, clipping), got)
