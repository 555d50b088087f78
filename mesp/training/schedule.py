"""Optimizers over the adapters only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from mesp.errors import MespError

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "constant")


def make_optimizer(
    params: list[torch.nn.Parameter], name: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    if not params:
        raise MespError("no trainable parameters: the model has no LoRA adapters")
    if not (lr > 0 and math.isfinite(lr)):
        raise MespError(f"--lr must be a positive finite number, got {lr}")
    if name == "sgd":  # the paper's optimizer: no state at all
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise MespError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine decay to 0 at `total`."""
    if kind not in SCHEDULES:
        raise MespError(f"unknown schedule {kind!r}; choose from {', '.join(SCHEDULES)}")
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / span)))
