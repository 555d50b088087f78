"""Resumable training state in one atomically written safetensors file (tensors + JSON only).

Tensors: the LoRA parameters, the optimizer state, torch's CPU and CUDA RNG states. JSON (in the
file's metadata): the states of Python's `random` and numpy's global RNG, the completed step, the
data stream position, the loss history, engine state, and a fingerprint of everything that must
not change across a resume (model, data, LoRA, engine, optimizer), so resuming another run's
directory is refused instead of silently mixing runs.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mesp.atomic_io import atomic_write
from mesp.errors import MespError
from mesp.models.transformer import CausalLM

STATE_FILE = "train_state.safetensors"


@dataclass
class TrainState:
    step: int = 0
    stream: dict[str, int] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    valid: list[dict[str, float]] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    rng: dict[str, Any] = field(default_factory=dict)
    # --keep-best / --early-stop (training/best.py): the best validation so far and how many
    # validations since did not beat it; saved so a resumed run stops where an uninterrupted
    # one does. Tracked whether or not the flags are on, so a resume may turn them on.
    best_loss: float | None = None
    best_step: int = 0
    since_best: int = 0


def rng_json() -> dict[str, Any]:
    """Python's `random` and numpy's global RNG state as JSON values (no pickle): both are
    Mersenne Twisters, a version/name, 624 words and a position, and a cached gaussian."""
    import numpy as np

    version, words, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": {"version": version, "state": list(words), "gauss_next": gauss_next},
        "numpy": {
            "name": name,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def set_rng_json(rng: dict[str, Any]) -> None:
    import numpy as np

    if "python" in rng:
        py = rng["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "numpy" in rng:
        n = rng["numpy"]
        keys = np.array(n["keys"], dtype=np.uint32)
        np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))


def cuda_rng_tensors() -> dict[str, torch.Tensor]:
    """One state per CUDA device, if this process has used CUDA (asking otherwise would
    initialize it: a context on every GPU for a CPU run, and nothing drawn to restore)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {f"rng.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}


def set_cuda_rng(tensors: dict[str, torch.Tensor]) -> None:
    states = [tensors[k] for k in sorted(tensors, key=lambda k: int(k.rsplit(".", 1)[1]))]
    if not states or not torch.cuda.is_available():
        return  # a CUDA run resumed without CUDA: the CPU has no CUDA generator to set
    n = min(len(states), torch.cuda.device_count())
    for i in range(n):
        torch.cuda.set_rng_state(states[i], i)


def capture(
    model: CausalLM, opt: torch.optim.Optimizer, state: TrainState
) -> dict[str, torch.Tensor]:
    """Tensors of the current training state: adapters, optimizer slots, torch RNG; the other
    RNG states go to `state.rng` (JSON)."""
    out = {
        f"lora.{n}": p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad
    }
    sd = opt.state_dict()
    for idx, slots in sd["state"].items():
        for k, v in slots.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"opt.{idx}.{k}"] = t.detach().contiguous()
    out["rng.torch"] = torch.get_rng_state()
    out.update(cuda_rng_tensors())
    state.rng = rng_json()
    state.param_groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return out


def save_state(path: Path, model: CausalLM, opt: torch.optim.Optimizer, st: TrainState) -> None:
    tensors = capture(model, opt, st)
    meta = {
        k: getattr(st, k)
        for k in ("step", "stream", "losses", "valid", "fingerprint", "param_groups", "rng")
        + ("best_loss", "best_step", "since_best")
    }
    # engine state (e.g. mezo's seed stream): tensors go to the file body, the rest to JSON
    meta["engine"] = {k: v for k, v in st.engine.items() if not isinstance(v, torch.Tensor)}
    tensors.update(
        {f"engine.{k}": v.contiguous() for k, v in st.engine.items() if isinstance(v, torch.Tensor)}
    )
    blob = {"mesp_state": json.dumps(meta)}
    atomic_write(path / STATE_FILE, lambda p: save_file(tensors, p, metadata=blob))


def load_state(path: Path) -> TrainState:
    f = path / STATE_FILE
    if not f.exists():
        raise MespError(f"{f}: no training state to resume from")
    try:
        with safe_open(str(f), framework="pt") as h:
            meta = json.loads((h.metadata() or {})["mesp_state"])
            tensors = {k: h.get_tensor(k) for k in h.keys()}
    except Exception as e:  # corrupt header, missing metadata key, bad JSON
        raise MespError(f"{f}: unreadable training state ({str(e).splitlines()[0]})") from None
    for k in [k for k in tensors if k.startswith("engine.")]:
        meta["engine"][k.removeprefix("engine.")] = tensors.pop(k)
    return TrainState(tensors=tensors, **meta)


# Data fields added after runs were first saved, with the value every older run had: recorded
# only when set otherwise, so a run saved before the field existed still resumes.
LATER_DATA_FIELDS = {"train_on": "all"}


def _recorded(fields: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if not (k in later and v == later[k])}


# Objective fields added after runs were saved: recorded only where they are not their
# default, so those runs resume (their fingerprints lack them)
LATER_OBJECTIVE_FIELDS = {"label_smoothing": 0.0}


def _engine_kwarg(k: str, v: Any) -> Any:
    if not is_dataclass(v) or isinstance(v, type):
        return v
    return _recorded(asdict(v), LATER_OBJECTIVE_FIELDS) if k == "objective" else asdict(v)


def fingerprint(
    loaded: Any,
    opts: Any,
    engine: str,
    engine_kwargs: dict[str, Any],
    data: Any,
    lora: Any,
    train: Any,
) -> dict[str, Any]:
    """What must stay the same for a resumed run to equal an uninterrupted one: the model and
    its storage, the engine and its options, the data, LoRA and training setup (less the
    settings a run may change on resume: its length, evaluation, saving, progress, keeping
    the best and early stopping)."""
    skip = {"steps", "eval_every", "eval_batches", "save_every", "progress"}
    skip |= {"keep_best", "early_stop"}  # what is kept and when to stop, not what is learned
    fp = {
        "model": loaded.source,
        "model_config": loaded.model.config.to_hf(),
        # auto is 4-bit but for a quantized GGUF's codes as stored: record which, so a run
        # started as `--quantize 4` resumes under the auto default where the base is the same
        "quantize": "stored" if loaded.base else "4" if opts.quantize == "auto" else opts.quantize,
        "group_size": opts.group_size,
        "dtype": opts.dtype,
        "engine": engine,
        **{k: _engine_kwarg(k, v) for k, v in engine_kwargs.items()},
        "data": _recorded(asdict(data), LATER_DATA_FIELDS),
        "lora": asdict(lora),
        "train": {k: v for k, v in asdict(train).items() if k not in skip},
    }
    return json.loads(json.dumps(fp))  # tuples -> lists, as they come back from the file


def check_fingerprint(
    st: TrainState, now: dict[str, Any], where: Path, skip: tuple[str, ...] = ()
) -> None:
    """Refuse to resume a run whose model/data/LoRA/optimizer setup differs from this one
    (`skip`: parts checked later, once known)."""
    for k in sorted((set(st.fingerprint) | set(now)) - set(skip)):
        if st.fingerprint.get(k) != now.get(k):
            raise MespError(
                f"{where}: cannot resume: it was trained with {k} = {st.fingerprint.get(k)!r}, "
                f"this run has {now.get(k)!r}"
            )


def restore(model: CausalLM, opt: torch.optim.Optimizer, st: TrainState) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, t in st.tensors.items():
            if k.startswith("lora."):
                params[k.removeprefix("lora.")].copy_(t)
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for k, t in st.tensors.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            slots.setdefault(int(idx), {})[name] = t.clone()
    opt.load_state_dict({"state": slots, "param_groups": st.param_groups})
    torch.set_rng_state(st.tensors["rng.torch"])
    set_cuda_rng({k: t for k, t in st.tensors.items() if k.startswith("rng.cuda.")})
    set_rng_json(st.rng)
