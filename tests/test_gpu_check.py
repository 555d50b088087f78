"""scripts/gpu-check on a machine without a CUDA GPU (this one): one line, exit 0, and nothing
installed or written first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"


def _run(python: str, tmp: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The script with PYTHON = a wrapper that logs each call's arguments, then runs `python`."""
    calls = tmp / "calls.log"
    wrapper = tmp / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {python} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PYTHON": str(wrapper), "OUT": str(tmp / "out")}
    r = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    return r, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_one_line_exit_0_nothing_installed(tmp_path: Path) -> None:
    r, calls = _run(sys.executable, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check"
    ]
    assert len(calls) == 1 and "pip" not in calls[0]  # only the check ran
    assert not (tmp_path / "out").exists()


def test_without_torch_one_line_exit_0(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    python = "/usr/bin/python3"  # the system's interpreter, where it has no torch
    if not Path(python).exists() or subprocess.run([python, "-c", "import torch"]).returncode == 0:
        pytest.skip("no system python without torch")
    r, calls = _run(python, bare)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"gpu-check: no PyTorch in {bare / 'python'}: nothing to check"
    ]
    assert len(calls) == 1 and not (bare / "out").exists()
