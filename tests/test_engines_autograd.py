"""bp and mebp compute bit-identical LoRA gradients (fp32), quantized base or not."""

from __future__ import annotations

import pytest
import torch

from mesp.engines import make_engine
from mesp.quant import QuantSpec
from tests.engine_cases import grads_of, model_with_adapter, padded_batch
from tests.hf_tiny import FAMILIES, n_lora


@pytest.mark.parametrize("quant", [None, QuantSpec(4, 32)], ids=["dense", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mebp_bit_identical_to_bp(family: str, quant: QuantSpec | None) -> None:
    model = model_with_adapter(family, quant)
    batch = padded_batch()
    loss_bp, g_bp = grads_of(make_engine("bp"), model, batch)
    loss_me, g_me = grads_of(make_engine("mebp"), model, batch)
    assert loss_bp == loss_me
    assert g_bp.keys() == g_me.keys() and len(g_bp) == 2 * n_lora(family) * 2
    for k in g_bp:
        assert torch.equal(g_bp[k], g_me[k]), k
        assert torch.count_nonzero(g_bp[k]) > 0, k
