"""Data parallel on gloo: 2 ranks with a global batch of 4 give the single-process adapter."""

from __future__ import annotations

import os
import subprocess
import sys
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
@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp", "mezo"])
def test_two_ranks_equal_one_process(engine: str, tmp_path: Path) -> None:
    """mezo shares only its per-probe scalar across ranks (same seeds everywhere). No
    --master-port: each launch rendezvous on a free port (a fixed one collides with any other
    run on the machine, this test's own in another checkout included)."""
    model = make_model_dir(tmp_path / "m", "qwen3")
    data = make_jsonl(tmp_path / "d.jsonl", 30)
    one = _train(model, data, tmp_path / "one", "--engine", engine)
    assert one.returncode == 0, one.stderr
    two = _train(model, data, tmp_path / "two", "--engine", engine, "--nproc", "2")
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

    def run(steps: int) -> list[str]:
        return [*common, "--steps", str(steps)]

    argv = _argv(model, data, out, *run(400))
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
    assert "was killed by SIGKILL" in last and "its output is" in last  # which rank, how, where
    saved = load_state(out).step
    r = subprocess.run(
        [*_argv(model, data, out), "--resume", str(out), "--steps", str(saved + 2)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"nproc": 2' in (out / "run_args.json").read_text()  # the resume kept 2 ranks
    fresh = tmp_path / "fresh"
    r = subprocess.run(
        _argv(model, data, fresh, *run(saved + 2)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_file(str(out / "adapter_model.safetensors"))
    b = load_file(str(fresh / "adapter_model.safetensors"))
    assert all(bool((a[k] == b[k]).all()) for k in a)


SHUTDOWN = """
import os, socket
import torch
from mesp.training.distributed import join, shutdown
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
join("gloo", 30.0)
torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # imports torch._dynamo
shutdown(clean=True)
tasks = os.listdir("/proc/self/task")
print(sorted(n for t in tasks if "gloo" in (n := open(f"/proc/self/task/{t}/comm").read().strip())))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names in /proc")
def test_shutdown_ends_the_gloo_threads_after_an_optimizer_imported_dynamo() -> None:
    """shutdown() frees the default group: no gloo thread (nor its sockets) is left for the
    interpreter's exit to tear down, even though the optimizer imported torch._dynamo (and so
    torch.distributed.nn, whose collectives take `group.WORLD` as a default argument)."""
    r = subprocess.run([sys.executable, "-c", SHUTDOWN], capture_output=True, text=True, timeout=99)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_launcher_names_the_dead_rank_its_signal_and_its_native_last_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A free port unless one is named; ranks 1.. write to their own log; the failure line says
    which rank died of what and where its log is, after the log's native abort message."""
    from mesp.training.launch import describe, torchrun_argv

    argv = torchrun_argv(3, 0, tmp_path, tmp_path / "r.json", ["train"])
    assert "--standalone" in argv and "--master-port" not in argv
    assert argv[argv.index("--redirects") + 1] == "1:3,2:3"  # rank 0 keeps the console
    assert "29500" in torchrun_argv(2, 29500, tmp_path, tmp_path / "r.json", ["train"])
    log = tmp_path / "stderr.log"
    native = "terminate called after throwing an instance of 'gloo::EnforceNotMet'"
    lines = ["mesp: warning: x", native, "Fatal Python error: Aborted", "", "Current thread 0x1"]
    log.write_text("\n".join(lines + ['  File "pair.py", line 1 in f'] * 80) + "\n")
    failures = [{"rank": 1, "exitcode": -6, "log": str(log)}]
    failures.append({"rank": 0, "exitcode": -15, "log": ""})
    line = describe({"failures": failures})
    assert line == (
        f"rank 1 was killed by SIGABRT; its output is in {log}; then rank 0 was killed by SIGTERM"
    )
    assert f"[rank1]: {native}\n[rank1]: Fatal Python error: Aborted" in capsys.readouterr().err
