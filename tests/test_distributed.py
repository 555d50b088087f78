"""Data parallel on gloo: 2 ranks with a global batch of 4 give the single-process adapter."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.tiny_dir import make_jsonl, make_model_dir, train_argv


def _argv(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return train_argv(
        model, data, out, *extra, python=True, quantize="none", seq_len=40, batch_size=4,
        steps=10, optimizer="sgd", lr=0.05, warmup=0, eval_every=0, eval_batches=1,
    )  # fmt: skip


def _train(model: Path, data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _argv(model, data, out, *extra), capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine,port", [("bp", 29611), ("mebp", 29621), ("mesp", 29631), ("mezo", 29651)]
)
def test_two_ranks_equal_one_process(engine: str, port: int, tmp_path: Path) -> None:
    """mezo shares only its per-probe scalar across ranks (same seeds everywhere)."""
    model = make_model_dir(tmp_path / "m", "qwen3")
    data = make_jsonl(tmp_path / "d.jsonl", 30)
    one = _train(model, data, tmp_path / "one", "--engine", engine)
    assert one.returncode == 0, one.stderr
    two = _train(
        model,
        data,
        tmp_path / "two",
        "--engine",
        engine,
        "--nproc",
        "2",
        "--master-port",
        str(port),
    )
    # torchrun's own traceback fills the tail of stderr: show each rank's mesp line first
    ranks = [ln for ln in two.stderr.splitlines() if "mesp:" in ln or "Error" in ln]
    assert two.returncode == 0, "\n".join(ranks[-20:]) + "\n---\n" + two.stderr[-2000:]
    a = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    # Two partial sums vs one: fp32 rounding only. MeZO divides the loss difference by 2·eps,
    # which magnifies that rounding ~50-fold, hence its looser bound.
    tol = 1e-4 if engine == "mezo" else 1e-6
    for k in a:
        assert (a[k] - b[k]).abs().max() <= tol, k
    log = (tmp_path / "two" / "log.jsonl").read_text()
    assert log.count('"loss"') == 10  # rank 0 alone logs


@pytest.mark.slow
def test_dead_rank_fails_the_others_promptly_and_the_run_resumes(tmp_path: Path) -> None:
    """One rank is SIGKILLed mid-run: the launcher ends with one line saying what to do, within
    a bounded time; resuming on 2 ranks gives bit for bit the adapter of an uninterrupted
    2-rank run (constant schedule: the lr does not depend on --steps)."""
    from mesp.training.checkpoint import load_state

    model = make_model_dir(tmp_path / "m", "llama")
    data = make_jsonl(tmp_path / "d.jsonl", 30)
    out = tmp_path / "run"
    common = ["--schedule", "constant", "--warmup", "0", "--save-every", "1", "--nproc", "2"]
    common += ["--dist-timeout", "30"]

    def run(dest: Path, port: int, steps: int) -> list[str]:
        return [*common, "--master-port", str(port), "--steps", str(steps)]

    argv = _argv(model, data, out, *run(out, 29641, 400))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "log.jsonl"
    deadline = time.time() + 300
    while (not log.exists() or log.read_text().count('"loss"') < 3) and time.time() < deadline:
        time.sleep(0.1)
    ranks = subprocess.run(
        ["pgrep", "-f", f"mesp train.*{out}"], capture_output=True, text=True
    ).stdout.split()
    workers = [int(x) for x in ranks if int(x) != p.pid]
    assert workers, "no worker processes found"
    os.kill(max(workers), 9)  # one rank dies hard
    t0 = time.time()
    _, err = p.communicate(timeout=180)
    assert p.returncode != 0 and time.time() - t0 < 120
    last = err.strip().splitlines()[-1]
    assert last.startswith("mesp: error: a data-parallel rank failed") and "--resume" in last
    saved = load_state(out).step
    r = subprocess.run(
        [*_argv(model, data, out), "--resume", str(out), "--steps", str(saved + 2),
         "--master-port", "29643"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"nproc": 2' in (out / "run_args.json").read_text()  # the resume kept 2 ranks
    fresh = tmp_path / "fresh"
    r = subprocess.run(
        _argv(model, data, fresh, *run(fresh, 29645, saved + 2)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_file(str(out / "adapter_model.safetensors"))
    b = load_file(str(fresh / "adapter_model.safetensors"))
    assert all(bool((a[k] == b[k]).all()) for k in a)
