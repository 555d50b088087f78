"""The mesp engine's hand-derived gradients equal autograd's (bp) on every family."""

from __future__ import annotations

import pytest
import torch

from mesp.engines import make_engine
from mesp.quant import QuantSpec
from tests.engine_cases import (
    DTYPES,
    assert_grads_match,
    grads_of,
    model_with_adapter,
    padded_batch,
)
from tests.hf_tiny import FAMILIES


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
@pytest.mark.parametrize("h_strategy", ["recompute", "store"])
@pytest.mark.parametrize("quant", [None, QuantSpec(4, 32)], ids=["dense", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mesp_matches_bp(
    family: str, quant: QuantSpec | None, h_strategy: str, dtype: torch.dtype
) -> None:
    """On MESP_TEST_DEVICE (cpu; cuda from scripts/gpu-check, which adds bf16)."""
    model = model_with_adapter(family, quant, dtype=dtype)
    batch = padded_batch()
    loss_bp, g_bp = grads_of(make_engine("bp"), model, batch)
    loss_ms, g_ms = grads_of(make_engine("mesp", h_strategy=h_strategy), model, batch)
    rtol = 1e-5 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps
    assert abs(loss_bp - loss_ms) <= rtol * abs(loss_bp)
    assert_grads_match(g_bp, g_ms, dtype)


def test_odd_sizes_gqa_long_sequence_small_vocab_chunks() -> None:
    """head_dim 24 (not a multiple of 16), rank 3, seq 77, GQA 6:2, window < seq."""
    model = model_with_adapter(
        "gemma3", rank=3, num_attention_heads=6, num_key_value_heads=2, sliding_window=9
    )
    batch = padded_batch(b=2, s=77)
    _, g_bp = grads_of(make_engine("bp"), model, batch)
    _, g_ms = grads_of(make_engine("mesp", chunk_rows=50, vocab_chunk=64), model, batch)
    assert_grads_match(g_bp, g_ms)


@pytest.mark.parametrize("h_strategy", ["recompute", "store"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiled_mlp_matches_bp(family: str, h_strategy: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Long inputs run the MLP in token tiles without autograd (forward, recompute) and the
    hand backward recomputes gate/up per tile: still bp's gradients (tile 16 < 3·23 tokens,
    not a divisor, so the last tile is short)."""
    from mesp.models.transformer import MLP

    model = model_with_adapter(family)
    batch = padded_batch()
    loss_bp, g_bp = grads_of(make_engine("bp"), model, batch)
    monkeypatch.setattr(MLP, "tile", 16)
    with torch.no_grad():
        assert model.model.layers[0].mlp.tiled(torch.zeros(3, 23, 8))
    loss_ms, g_ms = grads_of(make_engine("mesp", h_strategy=h_strategy), model, batch)
    assert abs(loss_bp - loss_ms) <= 1e-5 * abs(loss_bp)
    assert_grads_match(g_bp, g_ms)
