"""Training with mesp follows mebp step for step; bf16 gradients stay close to fp32."""

from __future__ import annotations

import torch

from mesp.engines import make_engine
from mesp.quant import QuantSpec
from tests.engine_cases import grads_of, model_with_adapter, padded_batch


def _sgd_losses(engine_name: str, steps: int = 50) -> list[float]:
    model = model_with_adapter("qwen3", QuantSpec(4, 32))
    engine = make_engine(engine_name)
    opt = torch.optim.SGD(model.lora_parameters(), lr=0.05)
    losses = []
    for i in range(steps):
        batch = padded_batch(b=2, s=19, seed=100 + i % 5)
        losses.append(engine.step(model, batch, batch.n_tokens) / batch.n_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def test_50_sgd_steps_follow_mebp() -> None:
    ref, ours = _sgd_losses("mebp"), _sgd_losses("mesp")
    assert ref[-1] < ref[0] - 0.05  # it trains
    for i, (a, b) in enumerate(zip(ref, ours, strict=True)):
        assert abs(a - b) <= 1e-6, (i, a, b)


def test_bf16_gradients_close_to_fp32() -> None:
    """bf16 has 8 mantissa bits; over two blocks and the head the gradient direction must
    survive: cosine >= 0.99 with the fp32 gradient of the same model and batch."""
    batch = padded_batch()
    g32 = grads_of(make_engine("mesp"), model_with_adapter("gemma3"), batch)[1]
    g16 = grads_of(make_engine("mesp"), model_with_adapter("gemma3", dtype=torch.bfloat16), batch)[
        1
    ]
    a = torch.cat([g32[k].flatten() for k in g32]).double()
    b = torch.cat([g16[k].flatten() for k in g32]).double()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.99
    assert all(g16[k].dtype == torch.bfloat16 for k in g16)
