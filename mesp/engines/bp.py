"""bp: plain autograd through the whole model; every block's activations stay alive until
backward. The reference all other engines are checked against."""

from __future__ import annotations

from mesp.batch import Batch
from mesp.engines.loss import LossSpec, autograd_loss_sum, loss_value
from mesp.models.transformer import CausalLM


class BPEngine:
    name = "bp"
    clipper = None  # DP-SGD (private.py): bp clips once its whole backward is done

    def __init__(self, loss: LossSpec | None = None) -> None:
        self.loss = loss or LossSpec()

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        loss = autograd_loss_sum(model, model.hidden(batch.input_ids), batch, self.loss)
        (loss / normalizer).backward()
        return loss_value(loss)
