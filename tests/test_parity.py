"""mesp's forward equals transformers' on every family (fp32, non-round sizes)."""

from __future__ import annotations

import pytest
import torch

from tests.hf_tiny import FAMILIES, hf_model, mesp_from_hf


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str) -> None:
    hf = hf_model(family)
    ours = mesp_from_hf(hf)
    ids = torch.randint(0, 211, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_with_head_dim_not_hidden_over_heads(family: str) -> None:
    """4 heads x head_dim 40 = 160 != hidden 72: q/o projections are not square."""
    hf = hf_model(family, num_attention_heads=4, num_key_value_heads=2, head_dim=40)
    ids = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(mesp_from_hf(hf)(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_gemma_final_logit_softcapping_matches() -> None:
    """A small cap (0.5) so that it bites: logits are squashed into (-0.5, 0.5)."""
    hf = hf_model("gemma3", final_logit_softcapping=0.5)
    ids = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
        assert ref.abs().max() < 0.5
        torch.testing.assert_close(mesp_from_hf(hf)(ids), ref, atol=1e-5, rtol=0)


def test_gemma_sliding_window_is_used() -> None:
    """With the window shorter than the sequence the result must differ from full attention."""
    hf = hf_model("gemma3")
    ours = mesp_from_hf(hf)
    hf_full = hf_model("gemma3", sliding_window=64)
    ours_full = mesp_from_hf(hf_full)
    ids = torch.randint(0, 211, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert not torch.allclose(ours(ids), ours_full(ids), atol=1e-4)
        torch.testing.assert_close(ours_full(ids), hf_full(ids).logits, atol=1e-4, rtol=0)
