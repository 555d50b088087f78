"""A NaN/inf loss or gradient stops training at that step, naming it, with the last good
adapter saved; --skip-nonfinite skips the batch instead, logs it, and finishes the run."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mesp.batch import Batch, Example
from mesp.engines import make_engine
from mesp.errors import MespError
from mesp.lora import LoraConfig, adapter_state
from mesp.models.transformer import CausalLM
from mesp.training import Interrupted, TrainConfig, train
from mesp.training.checkpoint import load_state
from tests.engine_cases import model_with_adapter

BAD = 3  # the poisoned step


class Poisoned:
    """Wraps an engine; its BAD-th step gets a NaN loss or an inf gradient. Records the
    adapter and the training state on disk as each step begins."""

    def __init__(self, inner: Any, kind: str, then: Any = None) -> None:
        self.inner, self.kind, self.then = inner, kind, then
        self.calls = 0
        self.adapters: dict[int, dict[str, torch.Tensor]] = {}  # step -> adapter before it
        self.saved: dict[int, int | None] = {}  # step -> the step saved on disk before it
        self.out: Path | None = None

    def __getattr__(self, name: str) -> Any:  # set_lr, state_dict, updates_params, ...
        return getattr(self.inner, name)

    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        self.calls += 1
        step = self.calls
        self.adapters[step] = {k: v.clone() for k, v in adapter_state(model).items()}
        f = self.out / "train_state.safetensors" if self.out else None
        self.saved[step] = load_state(self.out).step if f is not None and f.exists() else None
        if step != BAD:
            return self.inner.step(model, batch, normalizer)
        if self.then is not None:
            self.then()
        if self.kind == "nan_probe":  # mezo: every forward of this step gives NaN
            inner_loss = self.inner.loss_sum
            self.inner.loss_sum = lambda *a: float("nan")
            try:
                return self.inner.step(model, batch, normalizer)
            finally:
                self.inner.loss_sum = inner_loss
        loss = self.inner.step(model, batch, normalizer)
        if self.kind == "nan_loss":
            return float("nan")
        p = next(p for p in model.lora_parameters() if p.grad is not None)  # "inf_grad"
        p.grad.view(-1)[0] = math.inf
        return loss


def _examples(n: int = 12, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 200, (9 + i % 4,), generator=g).tolist()
        out.append(Example(ids=ids, mask=[0] + [1] * (len(ids) - 1)))
    return out


def _run(
    tmp_path: Path, engine: str, kind: str, then: Any = None, **cfg: Any
) -> tuple[CausalLM, Poisoned, Path, Any]:
    model = model_with_adapter("llama")
    eng = Poisoned(make_engine(engine), kind, then)
    out = tmp_path / "out"
    eng.out = out
    conf = TrainConfig(
        **{
            "steps": 5,
            "batch_size": 2,
            "lr": 1e-2,
            "warmup": 0,
            "eval_every": 0,
            "progress": False,
            **cfg,
        }
    )
    try:
        res: Any = train(model, eng, _examples(), [], conf, LoraConfig(rank=3, alpha=7.0), out)
    except (MespError, Interrupted) as e:
        res = e
    return model, eng, out, res


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], engine: str = "") -> bool:
    """Bit-identical; for mezo to rounding, since its probes move θ by +ε·z, −2ε·z, +ε·z and
    leave it where that arithmetic lands even when the step is then not taken."""
    if a.keys() != b.keys():
        return False
    if engine == "mezo":
        return all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    return all(torch.equal(a[k], b[k]) for k in a)


def _log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "engine,kind",
    [("bp", "nan_loss"), ("mesp", "nan_loss"), ("mebp", "inf_grad"), ("mezo", "nan_probe")],
)
def test_nonfinite_stops_at_that_step_keeping_the_last_good_adapter(
    engine: str, kind: str, tmp_path: Path
) -> None:
    model, eng, out, err = _run(tmp_path, engine, kind, save_every=2)
    assert isinstance(err, MespError), err
    msg = str(err)
    assert f"step {BAD}" in msg and str(out) in msg and "--skip-nonfinite" in msg
    assert "\n" not in msg
    assert eng.calls == BAD  # nothing after the bad step
    after_2 = eng.adapters[BAD]
    assert not _equal(after_2, eng.adapters[1], engine)  # steps 1-2 trained ...
    saved = load_file(out / "adapter_model.safetensors")
    assert _equal(saved, after_2, engine)  # ... and were kept
    assert _equal(adapter_state(model), after_2, engine)
    assert all(torch.isfinite(v).all() for v in after_2.values())
    assert [r["step"] for r in _log(out) if "loss" in r] == [1, 2]
    assert load_state(out).step == 2  # the save_every state, consistent with the adapter


@pytest.mark.parametrize(
    "engine,kind", [("mesp", "nan_loss"), ("bp", "inf_grad"), ("mezo", "nan_probe")]
)
def test_skip_nonfinite_skips_logs_and_finishes(engine: str, kind: str, tmp_path: Path) -> None:
    model, eng, out, res = _run(tmp_path, engine, kind, skip_nonfinite=True, save_every=100)
    assert not isinstance(res, Exception), res
    assert res.steps == 5 and len(res.train_losses) == 4
    assert all(math.isfinite(x) for x in res.train_losses)
    log = _log(out)
    assert [r for r in log if r.get("step") == BAD] == [
        {"step": BAD, "skipped": "non-finite loss or gradient"}
    ]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 4, 5]
    assert _equal(eng.adapters[BAD + 1], eng.adapters[BAD], engine)  # the skip changed nothing
    assert not _equal(eng.adapters[BAD], eng.adapters[1], engine)
    assert load_state(out).step == 5
    assert all(
        torch.isfinite(v).all() for v in load_file(out / "adapter_model.safetensors").values()
    )


def test_a_save_step_that_is_skipped_is_still_saved(tmp_path: Path) -> None:
    _, eng, out, res = _run(tmp_path, "mesp", "nan_loss", skip_nonfinite=True, save_every=BAD)
    assert not isinstance(res, Exception), res
    assert eng.saved[BAD] is None  # nothing saved before the bad step
    assert eng.saved[BAD + 1] == BAD  # the save due at the skipped step happened


def test_a_signal_during_a_skipped_step_stops_at_that_step(tmp_path: Path) -> None:
    def sigterm() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler only sets a flag

    _, eng, out, res = _run(
        tmp_path, "mesp", "nan_loss", then=sigterm, skip_nonfinite=True, save_every=100
    )
    assert isinstance(res, Interrupted), res
    assert res.code == 128 + signal.SIGTERM and f"step {BAD}" in str(res)
    assert eng.calls == BAD
    assert load_state(out).step == BAD
