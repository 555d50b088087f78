"""bp: plain autograd through the whole model; every block's activations stay alive until
backward. The reference all other engines are checked against."""

from __future__ import annotations

from mesp.data_batches import Batch
from mesp.engines.loss import ce_sum
from mesp.models.transformer import CausalLM


class BPEngine:
    name = "bp"

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        loss = ce_sum(model(batch.input_ids), batch.targets, batch.mask)
        (loss / normalizer).backward()
        return loss.item()
