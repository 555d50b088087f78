"""Resumable training state in one atomically written safetensors file (tensors + JSON only).

Tensors: the LoRA parameters, the optimizer state, torch's RNG state. JSON (in the file's
metadata): the completed step, the data stream position, the loss history, engine state, and a
fingerprint of everything that must not change across a resume (model, data, LoRA, engine,
optimizer), so resuming another run's directory is refused instead of silently mixing runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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


def capture(
    model: CausalLM, opt: torch.optim.Optimizer, state: TrainState
) -> dict[str, torch.Tensor]:
    """Tensors of the current training state: adapters, optimizer slots, RNG."""
    out = {
        f"lora.{n}": p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad
    }
    sd = opt.state_dict()
    for idx, slots in sd["state"].items():
        for k, v in slots.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"opt.{idx}.{k}"] = t.detach().contiguous()
    out["rng.torch"] = torch.get_rng_state()
    state.param_groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return out


def save_state(path: Path, model: CausalLM, opt: torch.optim.Optimizer, st: TrainState) -> None:
    tensors = capture(model, opt, st)
    meta = {
        k: getattr(st, k)
        for k in ("step", "stream", "losses", "valid", "fingerprint", "param_groups")
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


def check_fingerprint(st: TrainState, now: dict[str, Any], where: Path) -> None:
    """Refuse to resume a run whose model/data/LoRA/optimizer setup differs from this one."""
    for k in sorted(set(st.fingerprint) | set(now)):
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
