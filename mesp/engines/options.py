"""The engine flags (`EngineOptions`) and the keyword arguments they give `make_engine`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesp.engines import ENGINES
from mesp.engines.loss import LossSpec
from mesp.engines.objective import LOSS_TYPES, OBJECTIVES, Objective
from mesp.engines.spill import check_spill_dir
from mesp.errors import MespError


@dataclass
class EngineOptions:
    engine: str = field(
        default="mesp",
        metadata={
            "help": "gradient engine: bp (autograd), mebp (block checkpoints + autograd "
            "recompute), mesp (structured hand backward), mezo (zeroth order, forward only)",
            "choices": ENGINES,
        },
    )
    h_strategy: str = field(
        default="recompute",
        metadata={
            "help": "mesp: recompute LoRA's h = xAᵀ in backward, or store it (ablation)",
            "choices": ("recompute", "store"),
        },
    )
    offload: str = field(
        default="none",
        metadata={
            "help": "mebp/mesp: keep block checkpoints in memory, host memory, or on disk",
            "choices": ("none", "cpu", "disk"),
        },
    )
    offload_dir: str | None = field(
        default=None, metadata={"help": "directory for --offload disk / --stream-weights files"}
    )
    stream_weights: bool = field(
        default=False,
        metadata={"help": "mesp: frozen block weights on disk, one block in memory at a time"},
    )
    offload_fallback: bool = field(
        default=False,
        metadata={"help": "if the offload disk fails or fills, keep checkpoints in memory"},
    )
    zo_eps: float = field(default=1e-2, metadata={"help": "mezo: perturbation size"})
    zo_samples: int = field(default=1, metadata={"help": "mezo: SPSA probes per step"})
    zo_full: bool = field(
        default=False,
        metadata={
            "help": "mezo: perturb and train every weight, not only the adapters (needs "
            "--quantize none; the trained model is written to ADAPTER_OUT/model)"
        },
    )
    loss: str = field(
        default="ce",
        metadata={
            "help": "exact cross-entropy, or softmax over targets + a vocabulary subset "
            "(approximate)",
            "choices": ("ce", "sampled-softmax"),
        },
    )
    vocab_subset: int = field(
        default=1000,
        metadata={
            "help": "sampled-softmax: tokens besides the targets (half top-K of the head at "
            "probe rows, half drawn uniformly)",
            "metavar": "K",
        },
    )
    logits_masking: bool = field(
        default=True,
        metadata={"help": "form logits only for trained tokens (--no-logits-masking: all)"},
    )
    objective: str = field(
        default="sft",
        metadata={
            "help": "sft (token cross-entropy), or preference pairs: dpo (with the base as the "
            "reference) or orpo; --data then holds prompt/chosen/rejected rows",
            "choices": OBJECTIVES,
        },
    )
    beta: float = field(default=0.1, metadata={"help": "dpo: β, the KL penalty's strength"})
    orpo_lambda: float = field(default=0.1, metadata={"help": "orpo: λ, the odds-ratio weight"})
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": "dpo: the pair loss, TRL's formulas (sigmoid, TRL's default; ipo on mean "
            "log-probs)",
            "choices": LOSS_TYPES,
        },
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "dpo: ε, the chance a pair's labels are flipped (sigmoid, robust, "
            "exo_pair; conservative DPO)"
        },
    )


def engine_kwargs(
    o: EngineOptions,
    quantize: str,
    seed: int = 0,
    weight_decay: float = 0.0,
    keep_tapes: int = 0,
) -> dict[str, Any]:
    """`make_engine(o.engine, **engine_kwargs(o, …))`; refuses flag combinations the engine
    cannot honour, and a spill directory it could not write, before any work is done.
    keep_tapes: mesp's budget-aware recompute, from the planner (not a flag: --max-memory)."""
    kw: dict[str, Any] = {"loss": LossSpec(o.loss, o.vocab_subset, o.logits_masking, seed=seed)}
    objective = Objective(o.objective, o.beta, o.orpo_lambda, o.loss_type, o.label_smoothing)
    if objective.preference:  # (only then: an SFT run's fingerprint stays what it was)
        if o.engine == "mezo":
            raise MespError(f"--objective {o.objective} needs --engine bp, mebp or mesp, not mezo")
        if o.loss != "ce":
            raise MespError(f"--objective {o.objective} needs the exact loss (--loss ce)")
        if o.stream_weights:  # its no-tape log-prob passes run the model's plain forward
            raise MespError(f"--objective {o.objective} does not stream weights yet")
        kw["objective"] = objective
    if keep_tapes:
        if o.engine != "mesp":
            raise MespError(f"keeping block tapes needs --engine mesp, not {o.engine}")
        kw["keep_tapes"] = keep_tapes
    if o.engine in ("mesp", "mebp") and o.offload != "none":
        kw.update(offload=o.offload, offload_dir=o.offload_dir, offload_fallback=o.offload_fallback)
    if o.engine == "mesp":
        kw["h_strategy"] = o.h_strategy
        if o.stream_weights:
            kw.update(stream_weights=True, offload_dir=o.offload_dir)
    elif o.stream_weights:
        raise MespError("--stream-weights needs --engine mesp")
    if o.zo_full and (o.engine != "mezo" or quantize != "none"):
        raise MespError("--zo-full needs --engine mezo and --quantize none (an unquantized base)")
    if o.stream_weights or (o.offload == "disk" and not o.offload_fallback):
        flag = "--stream-weights" if o.stream_weights else "--offload disk"
        check_spill_dir(o.offload_dir, flag)
    if o.engine == "mezo":  # lr comes from the trainer's schedule each step (set_lr)
        kw.update(
            eps=o.zo_eps,
            samples=o.zo_samples,
            perturb_all=o.zo_full,
            seed=seed,
            weight_decay=weight_decay,
        )
    return kw
