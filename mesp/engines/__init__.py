"""Engines: how one batch's LoRA gradients are computed. All share one model and one loop.

An engine's `step(model, batch, normalizer)` leaves d(loss_sum / normalizer)/dθ accumulated in
each LoRA parameter's `.grad` and returns the batch's summed token loss (float). `normalizer`
is the number of trained tokens in the whole accumulation group, so accumulating micro-batches
gives exactly the gradient of the mean loss over the group.
"""

from __future__ import annotations

from typing import Protocol

from mesp.batch import Batch
from mesp.errors import MespError
from mesp.models.transformer import CausalLM


class Engine(Protocol):
    name: str

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float: ...


ENGINES = ("bp", "mebp", "mesp", "mezo")


def make_engine(name: str, **opts: object) -> Engine:
    """The engine `name`; with `objective` (a preference one) it trains on pairs: the
    engine's loss head takes per-token weights, its backward is unchanged (objective.py)."""
    objective = opts.pop("objective", None)
    engine = _make(name, **opts)
    if objective is None or not objective.preference:  # type: ignore[attr-defined]
        return engine
    from mesp.engines.objective import PreferenceEngine

    return PreferenceEngine(engine, objective)  # type: ignore[arg-type]


def _make(name: str, **opts: object) -> Engine:
    if name == "bp":
        from mesp.engines.bp import BPEngine

        return BPEngine(**opts)  # type: ignore[arg-type]
    if name == "mebp":
        from mesp.engines.mebp import MeBPEngine

        return MeBPEngine(**opts)  # type: ignore[arg-type]
    if name == "mesp":
        try:
            from mesp.engines.mesp import MeSPEngine
        except ImportError:
            raise MespError("engine 'mesp' is not available in this build") from None
        return MeSPEngine(**opts)  # type: ignore[arg-type]
    if name == "mezo":
        try:
            from mesp.engines.mezo import MeZOEngine
        except ImportError:
            raise MespError("engine 'mezo' is not available in this build") from None
        return MeZOEngine(**opts)  # type: ignore[arg-type]
    raise MespError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
