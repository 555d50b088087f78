"""Variants built in one process and measured side by side (`mesp bench dpo`, `mesp bench dp`):
each warmed up, its exact peak tracked on one step, then timed in rounds with the order rotated
(each variant takes each place in turn), so ratios come from steps seconds apart."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

# (step, frozen tensors, adapter tensors after the step) for the exact tracker
Built = tuple[Callable[[], float], list, Callable[[], list]]


def side_by_side(
    steps: dict[str, Built], warmup: int, rounds: int, tokens: int
) -> dict[str, dict[str, Any]]:
    """Per variant: peak_bytes, weights_bytes, over_weights_bytes, steps_s, median_s and
    tokens_per_s (`tokens` per step)."""
    from mesp.memory.tracker import measure_peak

    per: dict[str, dict[str, Any]] = {}
    for v, (step, frozen, adapter) in steps.items():
        for _ in range(warmup):
            step()
        gc.collect()
        peak = measure_peak(step, weights=frozen, adapter=adapter)
        per[v] = {"peak_bytes": peak["total"], "weights_bytes": peak["weights"],
                  "over_weights_bytes": peak["total"] - peak["weights"], "steps_s": []}  # fmt: skip
    names = list(steps)
    for i in range(rounds):
        for j in range(len(names)):
            v = names[(i + j) % len(names)]  # rotated: each variant takes each place in turn
            gc.collect()
            t = time.perf_counter()
            steps[v][0]()
            per[v]["steps_s"].append(time.perf_counter() - t)
    for p in per.values():
        p["median_s"] = statistics.median(p["steps_s"])
        p["tokens_per_s"] = tokens / p["median_s"]
    return per
