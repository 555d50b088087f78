"""Crash safety: SIGKILL at random steps + --resume gives the bit-identical adapter of an
uninterrupted run; SIGTERM/SIGINT finish the step, save and exit 143/130."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_dir import make_jsonl, make_model_dir

STEPS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    return make_model_dir(root / "m", "llama"), make_jsonl(root / "d.jsonl", 24)


def _argv(model: Path, data: Path, out: Path, engine: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mesp.cli",
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--engine",
        engine,
        "--quantize",
        "none",
        "--seq-len",
        "48",
        "--batch-size",
        "2",
        "--steps",
        str(STEPS),
        "--save-every",
        "1",
        "--eval-every",
        "4",
        "--eval-batches",
        "1",
        "--lr",
        "5e-3",
        "--rank",
        "2",
        "--no-progress",
        "--adapter-out",
        str(out),
    ]


def _steps_done(out: Path) -> int:
    log = out / "log.jsonl"
    return log.read_text().count('"loss"') if log.exists() else 0


def _run_until(argv: list[str], out: Path, kill_at: int, sig: int) -> int:
    """Start training, send `sig` once `kill_at` steps are logged; return the exit code."""
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while p.poll() is None and _steps_done(out) < kill_at and time.time() < deadline:
        time.sleep(0.05)
    if p.poll() is None:
        p.send_signal(sig)
    p.wait(timeout=300)
    return p.returncode


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp"])
def test_sigkill_resume_is_bit_identical(
    engine: str, setup: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = setup
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert subprocess.run(_argv(model, data, ref, engine), capture_output=True).returncode == 0
    kills = sorted(random.Random(engine).sample(range(2, STEPS), 3))
    for i, k in enumerate(kills):
        argv = _argv(model, data, out, engine)
        if i:
            argv += ["--resume", str(out)]
        assert _run_until(argv, out, k, signal.SIGKILL) == -signal.SIGKILL
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
    assert r.returncode == 2 and "cannot resume" in r.stderr and "Traceback" not in r.stderr
