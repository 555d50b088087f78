"""One training loop for every engine; the engine is the only plug point."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mesp.data_batches import BatchStream, Example, iter_eval_batches
from mesp.engines import Engine
from mesp.errors import MespError
from mesp.lora import LoraConfig, save_adapter
from mesp.models.transformer import CausalLM
from mesp.ops.cross_entropy import chunked_ce_loss
from mesp.schedule import lr_factor, make_optimizer

EVAL_VOCAB_CHUNK = 16384  # head slices of this many rows: Gemma's 262k vocabulary stays small


@dataclass
class TrainConfig:
    steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate"})
    optimizer: str = field(
        default="adamw",
        metadata={"help": "adamw or sgd (the paper's)", "choices": ("adamw", "sgd")},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay"})
    warmup: int = field(default=10, metadata={"help": "linear warmup steps"})
    schedule: str = field(
        default="cosine", metadata={"help": "after warmup", "choices": ("cosine", "constant")}
    )
    clip: float = field(default=1.0, metadata={"help": "max gradient norm (0 = off)"})
    eval_every: int = field(default=50, metadata={"help": "validate every N steps (0 = end)"})
    eval_batches: int = field(default=16, metadata={"help": "validation batches (0 = all)"})
    save_every: int = field(default=100, metadata={"help": "save the adapter every N steps"})
    seed: int = field(default=0, metadata={"help": "seed for LoRA init and data order"})
    progress: bool = field(default=True, metadata={"help": "show a live progress line"})

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum"):
            if getattr(self, name) <= 0:
                raise MespError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise MespError(f"--lr must be a positive finite number, got {self.lr}")


@dataclass
class TrainResult:
    steps: int
    train_losses: list[float]
    valid: list[dict[str, float]]
    adapter_dir: Path
    peak_rss_bytes: int | None
    seconds: float


@torch.no_grad()
def evaluate(
    model: CausalLM, examples: list[Example], batch_size: int, pad_id: int, max_batches: int = 0
) -> dict[str, float]:
    """Mean token loss and perplexity; the loss never forms full logits (chunked CE)."""
    total, n = 0.0, 0
    for i, batch in enumerate(iter_eval_batches(examples, batch_size, pad_id=pad_id)):
        if max_batches and i >= max_batches:
            break
        loss, k = chunked_ce_loss(
            model.hidden(batch.input_ids),
            batch.targets,
            batch.mask,
            model.head_weight(),
            model.config.final_logit_softcapping,
            chunk_rows=512,
            vocab_chunk=EVAL_VOCAB_CHUNK,
        )
        total += float(loss)
        n += k
    if n == 0:
        raise MespError("validation set has no trained tokens")
    loss = total / n
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": n}


def train(
    model: CausalLM,
    engine: Engine,
    train_examples: list[Example],
    valid_examples: list[Example],
    cfg: TrainConfig,
    lora: LoraConfig,
    out_dir: Path,
    pad_id: int = 0,
    base_name: str = "",
) -> TrainResult:
    from mesp.memory_rss import peak_rss_bytes

    params = model.lora_parameters()
    opt = make_optimizer(params, cfg.optimizer, cfg.lr, cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.steps, cfg.warmup, cfg.schedule)
    )
    stream = BatchStream(train_examples, cfg.batch_size, seed=cfg.seed, pad_id=pad_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_f = (out_dir / "log.jsonl").open("a")
    bar = _progress(cfg)
    losses: list[float] = []
    valid: list[dict[str, float]] = []
    t_start = time.perf_counter()

    def log(row: dict[str, Any]) -> None:
        log_f.write(json.dumps(row) + "\n")
        log_f.flush()

    def validate(step: int) -> None:
        model.eval()
        v = evaluate(model, valid_examples, cfg.batch_size, pad_id, cfg.eval_batches)
        valid.append({"step": step, **v})
        log({"step": step, "valid_loss": v["loss"], "valid_ppl": v["ppl"]})

    for step in range(cfg.steps):
        t0 = time.perf_counter()
        micro = [next(stream) for _ in range(cfg.grad_accum)]
        normalizer = sum(b.n_tokens for b in micro)
        if normalizer == 0:
            log({"step": step + 1, "skipped": "no trained tokens in batch"})
            continue
        loss_sum = sum(engine.step(model, b, normalizer) for b in micro)
        loss = loss_sum / normalizer
        if not math.isfinite(loss):
            save_adapter(model, out_dir, lora, base_name)
            raise MespError(f"non-finite loss at step {step + 1}; last adapter kept in {out_dir}")
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        if not getattr(engine, "updates_params", False):
            opt.step()
        opt.zero_grad(set_to_none=True)
        lr = sched.get_last_lr()[0]
        sched.step()
        dt = time.perf_counter() - t0
        tokens = sum(b.input_ids.numel() for b in micro)
        peak = peak_rss_bytes()
        losses.append(loss)
        row = {
            "step": step + 1,
            "loss": loss,
            "lr": lr,
            "tokens_per_s": tokens / dt,
            "step_s": dt,
            "peak_rss_mb": (peak or 0) / 2**20,
        }
        log(row)
        if bar is not None:
            bar.set_postfix(
                loss=f"{loss:.3f}",
                tok_s=f"{tokens / dt:.0f}",
                peak=f"{row['peak_rss_mb']:.0f}MB",
                refresh=False,
            )
            bar.update(1)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            validate(step + 1)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            save_adapter(model, out_dir, lora, base_name)
    if bar is not None:
        bar.close()
    validate(cfg.steps)
    save_adapter(model, out_dir, lora, base_name)
    log_f.close()
    plot_losses(out_dir / "loss.png", losses, valid)
    return TrainResult(
        cfg.steps, losses, valid, out_dir, peak_rss_bytes(), time.perf_counter() - t_start
    )


def _progress(cfg: TrainConfig):  # type: ignore[no-untyped-def]
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, desc="train", unit="step", dynamic_ncols=True)


def plot_losses(path: Path, losses: list[float], valid: list[dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, label="train", lw=1)
    if valid:
        ax.plot([v["step"] for v in valid], [v["loss"] for v in valid], "o-", label="valid")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
