"""Budget-aware recompute: mesp keeping the tapes of its last blocks computes plain mesp's
gradients bit for bit (torch.equal, not a tolerance), and the kept blocks really skip their
recompute."""

from __future__ import annotations

import pytest
import torch

from mesp.engines import make_engine, mesp_block
from mesp.errors import MespError
from mesp.models.transformer import MLP, Block
from mesp.quant import QuantSpec
from tests.engine_cases import grads_of, model_with_adapter, padded_batch
from tests.hf_tiny import FAMILIES


def three_blocks(family: str, quant: QuantSpec | None, **over: object):  # type: ignore[no-untyped-def]
    """A 3-block model: keeping 2 tapes leaves one recomputed block before the kept ones."""
    if family == "gemma3":  # sliding, full, sliding: both layer types kept and recomputed
        over = {"layer_types": ["sliding_attention", "full_attention"] * 2, **over}
        over["layer_types"] = over["layer_types"][:3]  # type: ignore[index]
    return model_with_adapter(family, quant, num_hidden_layers=3, **over)


def assert_same_bits(model, batch, store_h: bool = False, keeps=(1, 2, 3, 99)) -> None:  # type: ignore[no-untyped-def]
    h = "store" if store_h else "recompute"
    loss0, g0 = grads_of(make_engine("mesp", h_strategy=h), model, batch)
    for k in keeps:
        loss, g = grads_of(make_engine("mesp", h_strategy=h, keep_tapes=k), model, batch)
        assert loss == loss0, k
        assert g.keys() == g0.keys()
        bad = [n for n in g0 if not torch.equal(g[n], g0[n])]
        assert not bad, (k, bad)


@pytest.mark.parametrize("quant", [None, QuantSpec(4, 32)], ids=["dense", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_kept_tapes_give_plain_mesps_gradients_bit_for_bit(
    family: str, quant: QuantSpec | None
) -> None:
    assert_same_bits(three_blocks(family, quant), padded_batch())


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_kept_tapes_with_stored_h_and_the_tiled_mlp(family: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """h = xAᵀ stored, and the MLP in 16-token tiles (3·23 tokens: the last tile short), where
    the tape has no gate/up and the backward recomputes them per tile."""
    model = three_blocks(family, None)
    batch = padded_batch()
    assert_same_bits(model, batch, store_h=True, keeps=(3,))
    monkeypatch.setattr(MLP, "tile", 16)
    assert_same_bits(model, batch, keeps=(2, 3))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kept_tapes_past_the_real_mlp_tile(family: str) -> None:
    """600 tokens in one row > MLP.tile = 512: the forward and the kept forward both tile."""
    model = three_blocks(family, QuantSpec(4, 32), max_position_embeddings=1024)
    batch = padded_batch(b=1, s=600)
    with torch.no_grad():
        assert model.model.layers[0].mlp.tiled(torch.zeros(1, 600, 8))
    assert_same_bits(model, batch, keeps=(3,))


def test_kept_blocks_skip_the_recompute(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every block records exactly one tape per step: the last k in the forward, the rest in
    their backward; and where the attention kernels are not provably one call, the kept block
    takes its output from a plain forward (still the same gradients)."""
    model = three_blocks("qwen2", None)
    batch = padded_batch()
    calls: list[tuple[int, bool]] = []
    real = Block.forward

    def spy(self, x, ctx, cache=None, tape=None):  # type: ignore[no-untyped-def]
        calls.append((self.idx, tape is not None))
        return real(self, x, ctx, cache, tape)

    monkeypatch.setattr(Block, "forward", spy)
    _, g0 = grads_of(make_engine("mesp"), model, batch)
    assert calls == [(0, False), (1, False), (2, False), (2, True), (1, True), (0, True)]
    calls.clear()
    grads_of(make_engine("mesp", keep_tapes=2), model, batch)
    assert calls == [(0, False), (1, True), (2, True), (0, True)]
    calls.clear()
    monkeypatch.setattr(mesp_block, "fwd_matches_attention", lambda *a: False)
    _, g = grads_of(make_engine("mesp", keep_tapes=2), model, batch)
    assert calls == [(0, False), (1, True), (1, False), (2, True), (2, False), (0, True)]
    assert all(torch.equal(g[n], g0[n]) for n in g0)


def test_bad_keep_tapes() -> None:
    with pytest.raises(MespError, match="keep_tapes"):
        make_engine("mesp", keep_tapes=-1)
