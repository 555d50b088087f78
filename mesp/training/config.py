"""The training flags (`TrainConfig`) and what a run returns (`TrainResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mesp.errors import MespError


@dataclass
class TrainConfig:
    steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(
        default=2e-4, metadata={"help": "peak learning rate (mezo: 1e-4, the MeZO paper's)"}
    )
    optimizer: str = field(
        default="adamw",
        metadata={"help": "adamw or sgd (the paper's)", "choices": ("adamw", "sgd")},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay"})
    warmup: int = field(default=10, metadata={"help": "linear warmup steps"})
    schedule: str = field(
        default="cosine",
        metadata={"help": "after warmup (mezo: constant)", "choices": ("cosine", "constant")},
    )
    clip: float = field(default=1.0, metadata={"help": "max gradient norm (0 = off)"})
    eval_every: int = field(default=50, metadata={"help": "validate every N steps (0 = end)"})
    eval_batches: int = field(default=16, metadata={"help": "validation batches (0 = all)"})
    save_every: int = field(default=100, metadata={"help": "save the adapter every N steps"})
    seed: int = field(default=0, metadata={"help": "seed for LoRA init and data order"})
    progress: bool = field(default=True, metadata={"help": "show a live progress line"})
    loss_fraction: float = field(
        default=1.0,
        metadata={"help": "logits masking: train only the last share of each row's targets"},
    )
    skip_nonfinite: bool = field(
        default=False, metadata={"help": "skip batches with a NaN/inf loss instead of stopping"}
    )
    keep_best: bool = field(
        default=False,
        metadata={"help": "also keep the adapter of the best validation loss in ADAPTER_OUT/best/"},
    )
    early_stop: int = field(
        default=0,
        metadata={
            "help": "stop after N validations in a row without a better loss (0 = off)",
            "metavar": "N",
        },
    )

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum"):
            if getattr(self, name) <= 0:
                raise MespError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                )
        if not 0.0 < self.loss_fraction <= 1.0:
            raise MespError(f"--loss-fraction must be in (0, 1], got {self.loss_fraction}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise MespError(f"--lr must be a positive finite number, got {self.lr}")
        if self.early_stop < 0:
            raise MespError(f"--early-stop must be 0 (off) or positive, got {self.early_stop}")
        if self.early_stop and not self.eval_every:
            raise MespError(
                "--early-stop needs validations during training; --eval-every 0 validates "
                "only once, at the end"
            )


@dataclass
class TrainResult:
    steps: int
    train_losses: list[float]
    valid: list[dict[str, float]]
    adapter_dir: Path
    peak_rss_bytes: int | None
    seconds: float


def engine_defaults(engine: str) -> dict[str, object]:
    """The training flags whose default depends on the engine: mezo takes the MeZO paper's
    lr 1e-4 and a constant schedule; the others 2e-4 with cosine decay."""
    mezo = engine == "mezo"
    return {"lr": 1e-4 if mezo else 2e-4, "schedule": "constant" if mezo else "cosine"}
