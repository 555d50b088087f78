"""Crash safety: SIGKILL at random steps + --resume gives the bit-identical adapter of an
uninterrupted run; SIGTERM/SIGINT finish the step, save and exit 143/130, also when they arrive
during the final validation and save.

The SIGKILL runs save every SAVE_EVERY steps and are killed between save points, so each resume
goes back to the last save and replays the steps the killed process had done but not saved."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

STEPS = 10
SAVE_EVERY = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    return make_model_dir(root / "m", "llama"), make_jsonl(root / "d.jsonl", 24)


def _argv(model: Path, data: Path, out: Path, engine: str, save_every: int = 1) -> list[str]:
    return train_argv(
        model, data, out, python=True, engine=engine, quantize="none", seq_len=48, batch_size=2,
        steps=STEPS, save_every=save_every, eval_every=4, eval_batches=1, lr="5e-3", rank=2,
    )  # fmt: skip


def _steps_done(out: Path) -> int:
    """The last trained step in the log (0 if none yet)."""
    log = out / "log.jsonl"
    lines = log.read_bytes().decode(errors="replace").splitlines() if log.exists() else []
    last = 0
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a row caught half written
            continue
        if "loss" in row:
            last = row["step"]
    return last


def _saved_step(out: Path) -> int:
    from mesp.training.checkpoint import load_state

    return load_state(out).step


# `mesp train` that SIGKILLs itself as step MESP_TEST_KILL_AFTER + 1 begins (the trainer asks
# for its learning rate with the number of steps done): a kill at an exact step, so the test
# knows which steps were done but not saved, with nothing after the kill able to run.
KILL_AFTER = """
import os, signal, sys
import mesp.training.loop
k, lr_factor = int(os.environ["MESP_TEST_KILL_AFTER"]), mesp.training.loop.lr_factor
def at_step(done, *a, **kw):
    if done == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return lr_factor(done, *a, **kw)
mesp.training.loop.lr_factor = at_step
from mesp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp", "mezo"])
def test_sigkill_resume_is_bit_identical(
    engine: str, setup: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = setup
    ref, out = tmp_path / "ref", tmp_path / "run"
    r = subprocess.run(_argv(model, data, ref, engine, SAVE_EVERY), capture_output=True)
    assert r.returncode == 0, r.stderr
    # after the first save, never on a save step: each resume goes back to the last save and
    # replays the steps the killed process had done since
    between = [k for k in range(SAVE_EVERY + 1, STEPS) if k % SAVE_EVERY]
    kills = sorted(random.Random(engine).sample(between, 3))
    for i, k in enumerate(kills):
        argv = [sys.executable, "-c", KILL_AFTER, *_argv(model, data, out, engine, SAVE_EVERY)[3:]]
        if i:
            argv += ["--resume", str(out)]
        env = {**os.environ, "MESP_TEST_KILL_AFTER": str(k)}
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == -signal.SIGKILL, f"{engine}: run {i}: {r.returncode} {r.stderr}"
        assert _steps_done(out) == k  # it trained step k ...
        assert _saved_step(out) == k // SAVE_EVERY * SAVE_EVERY < k  # ... and did not save it
    r = subprocess.run(
        [sys.executable, "-m", "mesp.cli", "train", "--resume", str(out), "--no-progress"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    f = "adapter_model.safetensors"
    assert (ref / f).read_bytes() == (out / f).read_bytes(), f"{engine}: adapter differs"


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_and_exits(
    sig: int, code: int, setup: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = setup
    out = tmp_path / "run"
    argv = _argv(model, data, out, "mesp")
    argv[argv.index("--save-every") + 1] = "1000"  # only the signal makes it save
    # enough steps that the signal always lands mid-run (10 can all finish before it arrives)
    argv[argv.index("--steps") + 1] = "1000"
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while _steps_done(out) < 2 and p.poll() is None:
        time.sleep(0.05)
    os.kill(p.pid, sig)
    _, err = p.communicate(timeout=300)
    assert p.returncode == code, err
    assert "resume" in err and str(out) in err and "Traceback" not in err
    assert (out / "adapter_model.safetensors").exists()
    assert (out / "train_state.safetensors").exists()


def test_resume_of_another_run_is_refused(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = setup
    out = tmp_path / "run"
    argv = _argv(model, data, out, "mesp")
    argv[argv.index("--steps") + 1] = "2"
    assert subprocess.run(argv, capture_output=True).returncode == 0
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mesp.cli",
            "train",
            "--resume",
            str(out),
            "--rank",
            "3",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "cannot resume" in r.stderr, r.stderr
    assert r.stderr.startswith("mesp: error:") and r.stderr.count("\n") == 1, r.stderr
    assert {f.name: f.read_bytes() for f in out.iterdir()} == files  # the run is left as it was


def test_every_rng_state_round_trips(tmp_path: Path) -> None:
    """torch (CPU and, where used, CUDA), Python's `random` and numpy's global RNG: drawing
    after a restore repeats what was drawn after the save, cached gaussians included."""
    import numpy as np
    import torch
    from safetensors import safe_open

    from mesp.training.checkpoint import STATE_FILE, TrainState, load_state, restore, save_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    random.gauss(0, 1)  # leaves a cached second gaussian in each generator
    np.random.standard_normal()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.init()
        torch.rand(1, device="cuda")

    def draw() -> list[float]:
        out = [random.random(), random.gauss(0, 1), float(np.random.standard_normal())]
        out += [float(np.random.rand()), float(torch.rand(1)), float(torch.randn(1))]
        if use_cuda:
            out += torch.rand(3, device="cuda").tolist()
        return out

    save_state(tmp_path, model, opt, TrainState(step=7))
    first = draw()
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)  # reseeds CUDA too
    assert draw() != first
    st = load_state(tmp_path)
    restore(model, opt, st)
    assert draw() == first
    with safe_open(str(tmp_path / STATE_FILE), framework="pt") as h:
        meta = json.loads(h.metadata()["mesp_state"])
        keys = set(h.keys())
    assert set(meta["rng"]) == {"python", "numpy"}  # JSON, not pickle
    assert "rng.torch" in keys and any(k.startswith("rng.cuda.") for k in keys) == use_cuda


def test_state_without_python_numpy_rng_still_resumes(tmp_path: Path) -> None:
    """A state file written before the JSON RNG states existed restores what it has."""
    import torch

    from mesp.training.checkpoint import TrainState, load_state, restore, save_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_state(tmp_path, model, opt, TrainState(step=1))
    st = load_state(tmp_path)
    st.rng = {}
    restore(model, opt, st)
    assert st.step == 1


def test_runs_saved_before_train_on_existed_still_resume() -> None:
    """The default --train-on is left out of the fingerprint (older runs never recorded it);
    any other value is recorded, so changing it on resume is refused."""
    from types import SimpleNamespace

    from mesp.data import DataConfig
    from mesp.loading.session import ModelOptions
    from mesp.lora import LoraConfig
    from mesp.training import TrainConfig
    from mesp.training.checkpoint import fingerprint

    cfg = SimpleNamespace(to_hf=lambda: {"model_type": "llama"})
    loaded = SimpleNamespace(source="m", model=SimpleNamespace(config=cfg), base="")

    def fp(data: DataConfig) -> dict:
        return fingerprint(loaded, ModelOptions(), "mesp", {}, data, LoraConfig(), TrainConfig())

    assert "train_on" not in fp(DataConfig())["data"]
    assert fp(DataConfig(train_on="all-assistant"))["data"]["train_on"] == "all-assistant"


# `mesp train` that sends itself SIGINT from inside the validation after the last step: the
# moment after the step loop, where the final validation and save used to run unguarded.
SIGNAL_IN_LAST_VALIDATION = """
import os, signal, sys
import mesp.training.loop
steps, evaluate = int(os.environ["MESP_TEST_STEPS"]), mesp.training.loop.evaluate
def last_validation(*a, **kw):
    out = evaluate(*a, **kw)
    if os.environ.get("MESP_TEST_DONE") == "1":
        os.kill(os.getpid(), signal.SIGINT)
    return out
lr_factor = mesp.training.loop.lr_factor
def at_step(done, *a, **kw):
    if done == steps - 1:  # the last step begins: the next validation is the final one
        os.environ["MESP_TEST_DONE"] = "1"
    return lr_factor(done, *a, **kw)
mesp.training.loop.evaluate, mesp.training.loop.lr_factor = last_validation, at_step
from mesp.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_signal_during_the_last_validation_still_saves(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    """SIGINT while the final validation runs: it and the final save complete, the message says
    the run is complete and where it is saved, exit 130, no traceback."""
    model, data = setup
    out = tmp_path / "run"
    argv = _argv(model, data, out, "mesp")
    argv[argv.index("--save-every") + 1] = "1000"  # only the final save writes the adapter
    argv[argv.index("--eval-every") + 1] = "1000"  # the final validation is the only one
    argv = [sys.executable, "-c", SIGNAL_IN_LAST_VALIDATION, *argv[3:]]
    env = {**os.environ, "MESP_TEST_STEPS": str(STEPS)}
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 130, r.stderr
    assert "run is complete" in r.stderr and str(out) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert _saved_step(out) == STEPS
    assert (out / "adapter_model.safetensors").exists()
