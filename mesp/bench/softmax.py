"""`mesp bench softmax`: what `--loss sampled-softmax` costs in quality and buys in time, on
real pretrained models (SmolLM2-135M, vocabulary 49k; Gemma-3-270M, vocabulary 262k).

Each run is a plain `mesp train` in its own process: same model, data (Shakespeare), seed,
steps and learning rate; only the loss differs (exact CE, or targets + K proxy-chosen tokens).
Validation is always the exact CE, so the perplexities compare. Reported per run: valid
perplexity before and after, the median step time and tokens/s (steps after the first two),
and the process peak RSS. The exact-tracker memory of the loss head at long contexts is in the
ladder (`mesp bench ladder`, rung "+ sampled softmax").
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mesp.bench.output import write_row

LOSSES = ("ce", "sampled-softmax")


@dataclass
class SoftmaxConfig:
    model: str
    loss: str
    steps: int = 30
    seq: int = 128
    batch: int = 2
    vocab_subset: int = 1000
    lr: float = 1e-3
    seed: int = 0


def _slug(model: str) -> str:
    """A file-name-safe name for a model given by name or path."""
    return Path(model).name or "model"


def _train_argv(c: SoftmaxConfig, out: Path) -> list[str]:
    return [
        *("train", "--model", c.model, "--engine", "mesp", "--quantize", "4"),
        *("--seq-len", str(c.seq), "--batch-size", str(c.batch), "--steps", str(c.steps)),
        *("--lr", str(c.lr), "--warmup", "2", "--eval-batches", "8", "--seed", str(c.seed)),
        *("--loss", c.loss, "--vocab-subset", str(c.vocab_subset)),
        *("--adapter-out", str(out), "--no-progress", "--save-every", "0"),
    ]


def run_one(c: SoftmaxConfig, out_root: Path, timeout: float) -> dict[str, Any]:
    out = out_root / "runs" / "softmax" / f"{_slug(c.model)}_{c.loss}"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    argv = [sys.executable, "-m", "mesp", *_train_argv(c, out)]
    row: dict[str, Any] = {"table": "softmax", "config": asdict(c)}
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=os.environ)
    except subprocess.TimeoutExpired:
        return {**row, "status": "skipped", "reason": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {**row, "status": "failed", "reason": err}
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    times = [r["step_s"] for r in steps if "step_s" in r and r["step"] > 2]
    median = statistics.median(times) if times else None
    return {
        **row,
        "status": "ok",
        "ppl_before": summary["valid_ppl_before"],
        "ppl_after": summary["valid_ppl_after"],
        "step_s": median,
        "tokens_per_s": c.batch * c.seq / median if median else None,
        "peak_rss_mb": summary["peak_rss_mb"],
        "train_losses": [r["loss"] for r in steps if "loss" in r],
    }


def run_softmax(
    models: tuple[str, ...], base: SoftmaxConfig, out: Path, timeout: float, command: str
) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for loss in LOSSES:
            c = SoftmaxConfig(**{**asdict(base), "model": model, "loss": loss})
            row = run_one(c, out, timeout)
            row["command"] = command
            path = out / "rows" / "softmax" / f"{_slug(model)}_{loss}.json"
            rows.append(write_row(path, row, line, "softmax"))
    return rows


def line(row: dict[str, Any]) -> str:
    c = row["config"]
    head = f"{c['model']} {c['loss']}:"
    if row["status"] != "ok":
        return f"{head} {row['status']} ({row.get('reason', '')})"
    return (
        f"{head} valid ppl {row['ppl_before']:.2f} -> {row['ppl_after']:.2f}, "
        f"{row['step_s']:.2f} s/step, peak RSS {row['peak_rss_mb']:.0f} MB"
    )


def section(rows: list[dict[str, Any]]) -> list[str]:
    ok = {
        (r["config"]["model"], r["config"]["loss"]): r
        for r in rows
        if r.get("table") == "softmax" and r.get("status") == "ok"
    }
    if not ok:
        return []
    c = next(iter(ok.values()))["config"]
    lines = [
        "## Sampled softmax: quality, time, memory (real models)",
        "",
        f"`mesp train` on Shakespeare, mesp engine, 4-bit base, {c['steps']} steps of "
        f"{c['batch']}x{c['seq']} tokens, lr {c['lr']}, seed {c['seed']}; sampled softmax over "
        f"the targets + K={c['vocab_subset']} tokens. Valid perplexity is always exact CE.",
        "",
        "| model | loss | valid ppl before | valid ppl after | s/step | tokens/s | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for (model, loss), r in sorted(ok.items()):
        lines.append(
            f"| {model} | {loss} | {r['ppl_before']:.2f} | {r['ppl_after']:.2f} | "
            f"{r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    notes = []
    for model in sorted({m for m, _ in ok}):
        ce, ss = ok.get((model, "ce")), ok.get((model, "sampled-softmax"))
        if ce and ss:
            notes.append(
                f"- {model}: sampled softmax reaches valid ppl {ss['ppl_after']:.2f} against "
                f"{ce['ppl_after']:.2f} with exact CE "
                f"({100 * (ss['ppl_after'] / ce['ppl_after'] - 1):+.1f}%), at "
                f"{ce['step_s'] / ss['step_s']:.2f}x the step speed."
            )
    return [*lines, "", *notes, ""]


__all__ = ["SoftmaxConfig", "run_softmax", "section"]
