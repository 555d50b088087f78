"""`--max-memory`: refuse, before any weight is loaded, a setup the planner says will not fit,
naming a change that would; the trainer then watches the measured peak against the budget.
With engine mesp, the budget also sets how many blocks keep their tape (budget_tapes)."""

from __future__ import annotations

import os

from mesp.data import DataConfig
from mesp.errors import MespError
from mesp.loading.info import config_of, stored_weight_bytes
from mesp.loading.session import ModelOptions
from mesp.lora import LoraConfig
from mesp.memory.model import predict
from mesp.memory.plan import Run, kept_tapes, parse_bytes
from mesp.training.config import TrainConfig


def check_budget(
    max_memory: str | None,
    opts: ModelOptions,
    engine: str,
    data: DataConfig,
    lora: LoraConfig,
    train: TrainConfig,
    objective: str = "sft",
) -> int | None:
    """The budget in bytes (None: no budget), or a one-line error naming what would fit.
    `objective` dpo | orpo: train.batch_size already counts rows (two per pair)."""
    if not max_memory:
        return None
    budget = parse_bytes(max_memory)
    cfg = config_of(opts)
    weights = stored_weight_bytes(opts, cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # a data-parallel rank holds its slice
    rows = -(-train.batch_size // world)

    def need(eng: str, seq: int, rank: int) -> int:
        return int(
            predict(
                cfg, eng, seq, rows, rank, lora.targets, opts.quant, opts.torch_dtype,
                train.optimizer, weights=weights, objective=objective,
            )["total"]
        )  # fmt: skip

    seq, rank = data.seq_len, lora.rank
    have = need(engine, seq, rank)
    if have <= budget:
        return budget
    hints = [
        f"--engine {e}"
        for e in ("mesp", "mezo")  # mezo trains no preference objective
        if e != engine and (e == "mesp" or objective == "sft") and need(e, seq, rank) <= budget
    ]
    fits = [s for s in (2**k for k in range(4, 20)) if s < seq and need(engine, s, rank) <= budget]
    if fits:
        hints.append(f"--seq-len {fits[-1]}")
    ranks = [r for r in (32, 16, 8, 4, 2, 1) if r < rank and need(engine, seq, r) <= budget]
    if ranks:
        hints.append(f"--rank {ranks[0]}")
    raise MespError(
        f"--max-memory {max_memory}: engine {engine} at --seq-len {seq}, rank {rank} "
        f"needs about {have / 2**20:.0f} MiB; "
        + (" or ".join(hints) + " would fit" if hints else "no engine fits; try a smaller model")
    )


def budget_tapes(
    budget: int | None,
    opts: ModelOptions,
    engine: str,
    data: DataConfig,
    lora: LoraConfig,
    train: TrainConfig,
    objective: str = "sft",
) -> int:
    """Budget-aware recompute: how many of its last blocks mesp keeps the tape of under the
    budget `check_budget` returned (0 without a budget, or for another engine)."""
    if budget is None or engine != "mesp":
        return 0
    rows = -(-train.batch_size // int(os.environ.get("WORLD_SIZE", "1")))
    cfg = config_of(opts)
    run = Run(
        data.seq_len, rows, lora.rank, tuple(lora.targets), opts.quant, opts.torch_dtype,
        train.optimizer, stored_weight_bytes(opts, cfg), objective,
    )  # fmt: skip
    return kept_tapes(budget, cfg, run)
