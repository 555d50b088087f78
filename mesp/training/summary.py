"""The end of a `mesp train` run: summary.json and the closing lines (validation before and
after, peak memory, time; DP-SGD's guarantee)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mesp.atomic_io import atomic_write
from mesp.training.config import TrainResult
from mesp.training.privacy import DPSGD


def finish_run(
    out: Path, before: dict[str, Any], res: TrainResult, pairs: bool, privacy: DPSGD | None
) -> None:
    """Write OUT/summary.json and print what the run did."""
    after = res.valid[-1] if res.valid else {}
    summary = {
        "valid_ppl_before": before.get("ppl"),
        "valid_ppl_after": after.get("ppl"),
        **({"valid_accuracy_before": before.get("accuracy")} if pairs else {}),
        **({"valid_accuracy_after": after.get("accuracy")} if pairs else {}),
        "peak_rss_mb": (res.peak_rss_bytes or 0) / 2**20,
        "seconds": res.seconds,
        "adapter": str(out),
        **({"privacy": privacy.record(res.steps)} if privacy is not None else {}),
    }
    atomic_write(
        out / "summary.json", lambda p: Path(p).write_text(json.dumps(summary, indent=2) + "\n")
    )
    ppl = (
        f"valid perplexity {before['ppl']:.2f} -> {after['ppl']:.2f}"
        if before and after
        else "no validation set"
    )
    if pairs and before and after:
        ppl = (
            f"valid preference accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, "
            f"reward margin {before['margin']:.4f} -> {after['margin']:.4f}, "
            f"loss {before['loss']:.4f} -> {after['loss']:.4f}"
        )
    if privacy is not None:
        print(privacy.summary_line(res.steps))
    print(
        f"mesp: {ppl}; peak RSS {summary['peak_rss_mb']:.0f} MB; {res.seconds:.0f} s; "
        f"adapter in {out}"
    )
