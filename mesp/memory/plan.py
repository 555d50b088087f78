"""The planner behind `mesp plan` and `--max-memory`: which model and sequence length fit a
budget by the analytic model in `mesp.memory.model`; memory sizes as users write them."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mesp.config import ModelConfig
from mesp.errors import MespError
from mesp.loading.session import ModelOptions
from mesp.memory.model import ENGINES, predict, predict_sizes, resident_weight_bytes, weight_totals
from mesp.memory.sizes import sizes
from mesp.models.transformer import LORA_TARGETS
from mesp.quant import QuantSpec

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'500MB' → 500·10⁶, '8GB' → 8·10⁹, '1.5GiB' → 1.5·2³⁰, '4096' → 4096 bytes. KB/MB/GB/TB
    are decimal and KiB/MiB/GiB/TiB binary, as on the labels of phones and disks."""
    m = _SIZE.match(text)
    if not m or (m.group(3) and not m.group(2)):
        raise MespError(
            f"cannot read memory size {text!r}: give a number and a unit, e.g. 500MB, 8GB, 1.5GiB"
        )
    num, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    scale = 1024 ** "kmgt".index(unit) * 1024 if binary else _UNITS[unit]
    value = int(num * scale)
    if value <= 0:
        raise MespError(f"memory size {text!r} must be positive")
    return value


def model_config(model: str) -> tuple[ModelConfig, str]:
    """--model as a named shape (qwen2.5-0.5b, random:…), a config.json, or anything
    `mesp info` reads (model dir, .gguf, wheel name)."""
    from mesp.loading.info import config_of
    from mesp.loading.zoo import SHAPES, random_shape

    name = model.removeprefix("random:")
    if name in SHAPES:
        return random_shape(name), name
    p = Path(model)
    if p.is_file() and p.suffix == ".json":
        return ModelConfig.from_file(p), p.parent.name or str(p)
    return config_of(ModelOptions(model=model, quantize="none")), model


# Each family's ladder of published sizes (names in mesp.loading.zoo.SHAPES), smallest first.
FAMILY_SIZES: dict[str, list[str]] = {
    "qwen2": [
        "qwen2.5-0.5b",
        "qwen2.5-1.5b",
        "qwen2.5-3b",
        "qwen2.5-7b",
        "qwen2.5-14b",
        "qwen2.5-32b",
    ],
    "qwen3": ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"],
    "llama": [  # SmolLM2 is a Llama
        "smollm2-135m",
        "smollm2-360m",
        "llama-3.2-1b",
        "smollm2-1.7b",
        "llama-3.2-3b",
        "llama-3.1-8b",
    ],
    "gemma3": ["gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"],
    "mistral": ["mistral-7b-v0.3"],
    "smollm3": ["smollm3-3b"],
    "granite": ["granite-3.1-2b"],
    "olmo2": ["olmo2-7b"],
    "gemma2": ["gemma2-2b"],
    "phi3": ["phi-3-mini", "phi-4-mini"],
}


def shape_config(name: str) -> ModelConfig:
    """A named published shape (mesp.loading.zoo.SHAPES), with or without `random:`."""
    from mesp.loading.zoo import random_shape

    return random_shape(name)


@dataclass(frozen=True)
class Run:
    """Everything but the model and the engine that the peak depends on."""

    seq_len: int = 256
    batch: int = 1
    rank: int = 8
    targets: tuple[str, ...] = LORA_TARGETS
    quant: QuantSpec | None = QuantSpec()
    dtype: torch.dtype = torch.float32
    optimizer: str = "adamw"
    weights: int | None = None  # frozen weight bytes a file fixes (see memory.model.predict)
    objective: str = "sft"  # dpo | orpo: `batch` rows are batch/2 (chosen, rejected) pairs

    def resident(self, cfg: ModelConfig) -> int:
        if self.weights is not None:
            return self.weights
        return resident_weight_bytes(cfg, self.quant, self.dtype)

    def predict(
        self, cfg: ModelConfig, engine: str, seq_len: int | None = None, keep_tapes: int = 0
    ) -> dict:
        s = seq_len or self.seq_len
        return predict(
            cfg,
            engine,
            s,
            self.batch,
            self.rank,
            self.targets,
            self.quant,
            self.dtype,
            self.optimizer,
            keep_tapes,
            self.weights,
            self.objective,
        )


# Budget-aware recompute fills only this share of the budget with mesp's kept tapes: the model
# is within ±10% of the measured peak, and the trainer stops a run whose measured peak crosses
# --max-memory, so tapes kept up to the last byte would turn a faster run into a stopped one.
TAPE_FILL = 0.9


def kept_tapes(budget_bytes: int, cfg: ModelConfig, run: Run = Run()) -> int:
    """How many of its last blocks' tapes mesp keeps within the budget: the largest k whose
    predicted peak stays within TAPE_FILL of it (0: every block recomputes, as plain mesp)."""
    s = sizes(cfg, run.seq_len, run.batch, run.rank, run.targets, run.quant, run.dtype)
    weights = run.resident(cfg)

    def fits(k: int) -> bool:
        total = predict_sizes(s, weights, "mesp", run.optimizer, k, run.objective)["total"]
        return int(total) <= TAPE_FILL * budget_bytes

    k = s.L
    while k > 0 and not fits(k):  # the peak grows with k: the first that fits is the largest
        k -= 1
    return k


def largest_model(
    budget_bytes: int, family_sizes: Sequence[str], engine: str, run: Run = Run()
) -> dict:
    """Walk the sizes (names of published shapes) and report each one's predicted peak; the
    largest (most parameters) that fits the budget is `largest`, or None."""
    rows = []
    for name in family_sizes:
        cfg = shape_config(name)
        total = int(run.predict(cfg, engine)["total"])
        params = weight_totals(
            json.dumps(cfg.to_hf(), sort_keys=True, default=str), None, run.dtype
        )[0]
        rows.append(
            {"model": name, "params": params, "total": total, "fits": total <= budget_bytes}
        )
    fitting = [r for r in rows if r["fits"]]
    best = max(fitting, key=lambda r: r["params"])["model"] if fitting else None
    return {"engine": engine, "budget": budget_bytes, "largest": best, "rows": rows}


def longest_seq(
    budget_bytes: int, cfg: ModelConfig, engine: str, run: Run = Run(), max_len: int = 0
) -> int:
    """Largest sequence length (≤ max_len, default the model's maximum) whose predicted peak fits
    the budget, by bisection (the peak grows with S); 0 when not even one token fits."""
    s0 = sizes(cfg, 1, run.batch, run.rank, run.targets, run.quant, run.dtype)
    weights = run.resident(cfg)

    def fits(n: int) -> bool:
        s = sizes(cfg, n, run.batch, run.rank, run.targets, run.quant, run.dtype)
        p = predict_sizes(s, weights, engine, run.optimizer, 0, run.objective)
        return int(p["total"]) <= budget_bytes

    hi = max_len or cfg.max_position_embeddings
    if not fits(s0.S):
        return 0
    lo = 1
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan(budget_bytes: int, cfg: ModelConfig, name: str, run: Run = Run()) -> dict:
    """The JSON-able plan behind `mesp plan`: per engine the predicted parts and peak, whether
    it fits, the longest sequence that fits, and the largest model of the family that fits."""
    ladder = FAMILY_SIZES.get(cfg.family, [])
    engines = {}
    # a preference objective needs a gradient: mezo does not train it (PreferenceEngine)
    for eng in [e for e in ENGINES if run.objective == "sft" or e != "mezo"]:
        p = run.predict(cfg, eng)
        engines[eng] = {
            **p,
            "fits": int(p["total"]) <= budget_bytes,
            "longest_seq": longest_seq(budget_bytes, cfg, eng, run),
            # the family's other sizes have no file: their weights follow from run.quant
            "largest_model": largest_model(budget_bytes, ladder, eng, replace(run, weights=None))[
                "largest"
            ],
        }
    q = run.quant
    stored = run.weights is not None
    tapes = kept_tapes(budget_bytes, cfg, run) if engines["mesp"]["fits"] else 0
    engines["mesp"]["budget_tapes"] = {
        "kept": tapes,
        "layers": cfg.num_hidden_layers,
        "total": int(run.predict(cfg, "mesp", keep_tapes=tapes)["total"]),
    }
    return {
        "budget": budget_bytes,
        "model": name,
        "family": cfg.family,
        "family_sizes": ladder,
        "seq_len": run.seq_len,
        "batch": run.batch,
        "objective": run.objective,
        "rank": run.rank,
        "targets": list(run.targets),
        "quant": "as stored"
        if stored
        else ("none" if q is None else f"{q.bits}-bit group {q.group_size}"),
        "dtype": str(run.dtype).removeprefix("torch."),
        "optimizer": run.optimizer,
        "engines": engines,
    }


def _pairs(p: dict) -> str:
    """' rows (N dpo pairs)' under a preference objective, else ''."""
    o = p.get("objective", "sft")
    n = p["batch"] // 2
    return "" if o == "sft" else f" rows ({n} {o} pair{'' if n == 1 else 's'})"


def format_plan(p: dict) -> str:
    """A readable table of `plan`'s result, in MiB."""
    mib = 2**20
    head = (
        f"budget {p['budget'] / mib:,.0f} MiB · {p['model']} · seq {p['seq_len']} × batch "
        f"{p['batch']}{_pairs(p)} · rank {p['rank']} · {p['quant']} base · {p['dtype']} · "
        f"{p['optimizer']}"
    )
    cols = (
        "weights",
        "adapter",
        "optimizer",
        "grads_at_peak",
        "checkpoints",
        "working",
        "logits",
        "total",
    )
    names = ("weights", "adapter", "optim", "grads", "ckpts", "activ", "logits", "peak")
    lines = [
        head,
        f"{'engine':6s} "
        + " ".join(f"{c:>8s}" for c in names)
        + f"  {'fits':4s} {'max seq':>8s}  largest {p['family']} that fits",
    ]
    for eng, r in p["engines"].items():
        nums = " ".join(f"{int(r[c]) / mib:8.1f}" for c in cols)
        fits = "yes" if r["fits"] else "no"
        lines.append(
            f"{eng:6s} {nums}  {fits:4s} {r['longest_seq']:>8d}  {r['largest_model'] or '-'}"
        )
    lines.append(
        "MiB of tensors at each engine's peak moment (grads: those live then; activ: activations"
        " and temporaries; logits: the loss head's logits, log-softmax and rows, 0 when the peak"
        " is elsewhere); the Python and torch runtime add their own"
    )
    bt = p["engines"].get("mesp", {}).get("budget_tapes")
    if bt is not None:  # budget-aware recompute: the split `--max-memory` would give mesp
        k, n, budget = bt["kept"], bt["layers"], f"--max-memory {p['budget'] / mib:,.0f} MiB"
        if not p["engines"]["mesp"]["fits"]:
            lines.append(f"with {budget} mesp does not fit: no tape is kept")
        else:
            lines.append(
                f"with {budget}, mesp keeps the tape of the last {k} of {n} blocks and "
                f"recomputes {n - k} (peak {bt['total'] / mib:.1f} MiB; tapes fill at most "
                f"{TAPE_FILL:.0%} of the budget)"
            )
    return "\n".join(lines)
