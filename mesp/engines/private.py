"""DP-SGD on an exact engine (bp, mebp, mesp): the batch's per-example gradients clipped as each
block's backward makes them (clipping.py), summed into the LoRA parameters' .grad.

Each row's loss is the mean cross-entropy over its own trained tokens (per-token weights 1/n_e,
the loss head's weights, so the engines' backward is SFT's), so an example's gradient does not
depend on the others in its batch. `step` returns Σ_e (row e's mean loss); the noise and the
division by the expected batch size are the training loop's (training/privacy.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mesp.batch import Batch
from mesp.engines.clipping import ExampleClipper
from mesp.errors import MespError
from mesp.models.transformer import CausalLM


class PrivateEngine:
    example_mean = True  # step returns the sum of its rows' mean losses; the loop divides by rows

    def __init__(self, inner: Any, clip: float, clipping: str) -> None:  # an Engine (no cycle)
        if inner.name == "mezo":
            raise MespError(
                "DP-SGD clips per-example gradients; mezo forms none (use --engine bp, mebp or "
                "mesp)"
            )
        if getattr(inner, "objective", None) is not None:
            raise MespError("DP-SGD trains --objective sft only (a pair's loss couples its rows)")
        self.inner, self.clip, self.clipping, self.name = inner, clip, clipping, inner.name
        self.loss = getattr(inner, "loss", None)
        self.last_scale = None  # the last micro-batch's clip scales (tests, logs)

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        """Clipped Σ_e ∇(row e's mean loss) added to .grad; `normalizer` is not used."""
        n = batch.mask.sum(1, keepdim=True).clamp_min(1)
        w = batch.mask.float() / n  # rows with no trained token weigh 0: a zero gradient
        rows, seq = batch.mask.shape
        clipper = ExampleClipper(model, self.clip, self.clipping, rows, seq)
        clipper.attach()
        self.inner.clipper = clipper
        try:
            loss = self.inner.step(model, replace(batch, weights=w), 1)
            self.last_scale = clipper.finish()
        finally:
            clipper.detach()
            self.inner.clipper = None
        return loss

    def __getattr__(self, name: str) -> object:  # attach, state_dict, … of the inner engine
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
