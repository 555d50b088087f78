"""mesp (exact gradients, AdamW) and mezo (SPSA, SGD) trained side by side from the same
weights, adapter init and batch order: valid loss by step and by training second."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mesp.batch import Example
from mesp.bench.grads import GradStudy
from mesp.bench.output import pyplot
from mesp.data import DataConfig, load_splits, pad_id_of
from mesp.engines import make_engine
from mesp.errors import MespError
from mesp.loading.session import ModelOptions, open_model
from mesp.lora import LoraConfig, apply_lora
from mesp.models.transformer import CausalLM
from mesp.training import TrainConfig, train
from mesp.training.evaluate import evaluate


def run_convergence(opts: ModelOptions, s: GradStudy) -> list[str]:
    """`mesp analyze-grads --convergence STEPS`; returns the lines to print."""
    first = open_model(opts, seed=s.seed)
    if first.tokenizer is None:
        raise MespError("--convergence needs a model with a tokenizer (not random:SHAPE)")
    splits = load_splits(DataConfig(path=s.data, seq_len=s.seq_len), first.tokenizer)
    lora = LoraConfig(rank=s.rank)
    cache = [first]

    def make_model() -> CausalLM:
        loaded = cache.pop() if cache else open_model(opts, seed=s.seed)
        apply_lora(loaded.model, lora, seed=s.seed)
        return loaded.model

    cfg = TrainConfig(
        steps=s.convergence,
        batch_size=s.batch_size,
        lr=s.lr,
        warmup=0,
        schedule="constant",
        eval_every=max(1, s.convergence // 10),
        eval_batches=s.eval_batches,
        save_every=s.convergence,
        seed=s.seed,
        progress=False,
    )
    mezo = {"lr": s.zo_lr, "eps": s.eps, "seed": s.seed}
    res = convergence(
        make_model,
        splits["train"],
        splits["valid"],
        cfg,
        lora,
        Path(s.out),
        engine_opts={"mezo": mezo},
        pad_id=pad_id_of(first.tokenizer),
    )
    lines = [
        f"mesp: {name}: valid loss {r['valid_loss'][0]:.4f} -> {r['valid_loss'][-1]:.4f} "
        f"in {r['steps'][-1]} steps, {r['total_seconds']:.0f} s"
        for name, r in res["runs"].items()
    ]
    return [*lines, f"mesp: wrote {Path(s.out) / 'convergence.json'} and convergence.png"]


def convergence(
    make_model: Callable[[], CausalLM],
    train_examples: list[Example],
    valid_examples: list[Example],
    cfg: Any,
    lora: LoraConfig,
    out_dir: Path,
    engines: Sequence[str] = ("mesp", "mezo"),
    engine_opts: dict[str, dict[str, Any]] | None = None,
    pad_id: int = 0,
) -> dict[str, Any]:
    """Train a fresh model (`make_model()`: same weights and adapter init each call) with each
    engine on the same data and TrainConfig `cfg`; valid loss against steps and against
    training seconds (validation excluded), as convergence.json and convergence.png.
    MeZO's lr and weight decay come from engine_opts["mezo"] (default: cfg's)."""
    runs: dict[str, Any] = {}
    for name in engines:
        opts = dict((engine_opts or {}).get(name, {}))
        if name == "mezo":
            opts.setdefault("lr", cfg.lr)
            opts.setdefault("weight_decay", cfg.weight_decay)
        engine = make_engine(name, **opts)
        # the trainer sets the engine's lr every step from the schedule: give mezo its own
        run_cfg = replace(cfg, lr=opts["lr"]) if name == "mezo" else cfg
        run_dir = out_dir / name
        model = make_model()
        start = evaluate(model, valid_examples, cfg.batch_size, pad_id, cfg.eval_batches)
        res = train(model, engine, train_examples, valid_examples, run_cfg, lora, run_dir, pad_id)
        elapsed = _elapsed_by_step(run_dir / "log.jsonl")
        valid = [{"step": 0, **start}, *res.valid]
        runs[name] = {
            "steps": [int(v["step"]) for v in valid],
            "seconds": [elapsed.get(int(v["step"]), 0.0) for v in valid],
            "valid_loss": [v["loss"] for v in valid],
            "train_loss": res.train_losses,
            "total_seconds": res.seconds,
        }
    result = {"engines": list(engines), "runs": runs}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "convergence.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot_convergence(result, out_dir / "convergence.png")
    return result


def _elapsed_by_step(log: Path) -> dict[int, float]:
    """Cumulative step seconds at each step, from the trainer's log.jsonl (only this run's
    rows: the file is appended to, so a step number seen again restarts the sum)."""
    out: dict[int, float] = {}
    total = 0.0
    for line in log.read_text().splitlines():
        row = json.loads(line)
        if "step_s" not in row:
            continue
        if int(row["step"]) == 1:
            out, total = {}, 0.0
        total += float(row["step_s"])
        out[int(row["step"])] = total
    return out


def _plot_convergence(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name, r in result["runs"].items():
        a.plot(r["steps"], r["valid_loss"], "o-", label=name)
        b.plot(r["seconds"], r["valid_loss"], "o-", label=name)
    a.set_xlabel("step")
    b.set_xlabel("training seconds")
    a.set_ylabel("valid loss")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
