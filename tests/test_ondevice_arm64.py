"""The native runner on ARM64, the phones' instruction set (issue 28 item 6).

`scripts/build-ondevice --target aarch64` cross-builds the runner with Debian's
g++-aarch64-linux-gnu against the executorch manylinux_2_28_aarch64 wheel; qemu-user runs it.
On the tiny exports of all four families, the same `.pte` files, rows and steps must give the
x86-64 runner's losses and adapters within 1e-5 of their magnitude.

They are not bit-identical, and need not be: XNNPACK picks its matmul microkernels per CPU (NEON
on AArch64, AVX2/AVX-512 on x86-64), with different tile shapes and so a different order of
float32 sums, and expf/logf come from each platform's libm. The drift after a few steps is a
few float32 ulps of the values (measured after 3 SGD steps: adapters within 7e-8..1.4e-7 of
their largest entry on the four families); a wrong operator, layout or ABI would be off by orders
of magnitude more.

qemu translates every instruction (tens of times slower than native), so each family trains 3
steps on one thread. Slow suite; skipped without the cross compiler or qemu, except under
MESP_REQUIRE_REAL=1 (scripts/test-slow, hence CI, which installs them), where that fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import export_cases as T

pytest.importorskip("executorch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ARM_BIN = ROOT / "build" / "ondevice-aarch64" / "mesp-runner"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's libc6-arm64-cross: qemu-aarch64 -L
# Four families' exports of tests/test_ondevice_et.py: Qwen2 all 4-bit, the others with a 4-bit
# and a dense base in each block (T.mixed_model), so the ARM64 build runs both kinds of matmul.
CASES = [("qwen2", "q4"), *((f, "mixed") for f in ("llama", "qwen3", "gemma3"))]
STEPS = 3
TOL = 1e-5  # relative to the largest magnitude of each tensor (the bound)


def _missing(why: str) -> None:
    """Skip without the toolchain; fail under MESP_REQUIRE_REAL=1 (scripts/test-slow, hence CI),
    so the slow step can never pass by testing nothing. scripts/test-slow installs the packages
    as root; it sets MESP_SKIP_ARM64=1 only where it cannot (not root, not in CI)."""
    required = os.environ.get("MESP_REQUIRE_REAL") == "1"
    if required and os.environ.get("MESP_SKIP_ARM64") != "1":
        pytest.fail(f"{why} (MESP_REQUIRE_REAL=1)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def arm_bin() -> Path:
    """scripts/build-ondevice --target aarch64, once per session."""
    if shutil.which("aarch64-linux-gnu-g++") is None:
        _missing("no aarch64-linux-gnu-g++ (apt-get install -y g++-aarch64-linux-gnu)")
    if shutil.which("qemu-aarch64") is None or not Path(SYSROOT).is_dir():
        _missing(f"no qemu-aarch64 or no {SYSROOT} (apt-get install -y qemu-user)")
    r = subprocess.run(
        [str(ROOT / "scripts" / "build-ondevice"), "--target", "aarch64"],
        cwd=ROOT,
        env={**os.environ, "MESP_VENV": sys.prefix},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"build-ondevice --target aarch64 failed:\n{r.stdout}\n{r.stderr}"
    assert ARM_BIN.is_file()
    return ARM_BIN


def _train(prefix: list[str], art: Path, data: Path, out: Path) -> list[float]:
    log = out.with_suffix(".jsonl")
    argv = [*prefix, str(art), "--data", str(data), "--steps", str(STEPS), "--lr", repr(T.LR)]
    argv += ["--threads", "1", "--quiet", "--out", str(out), "--json-log", str(log)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (argv, r.stdout, r.stderr)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_aarch64_binary_starts_under_qemu(arm_bin: Path) -> None:
    head = arm_bin.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64
    r = subprocess.run(
        ["qemu-aarch64", "-L", SYSROOT, str(arm_bin), "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "usage: mesp-runner" in r.stdout, r.stderr


@pytest.mark.parametrize("family,quant", CASES)
def test_aarch64_trains_like_x86_64(  # type: ignore[no-untyped-def]
    et_cases, runner_bin: Path, arm_bin: Path, tmp_path: Path, family: str, quant: str
) -> None:
    case = et_cases(family, quant, also=[c for c in CASES if c != (family, quant)])
    # One batch of B rows, so every step sees the same rows and the loss must fall.
    data = T._write_jsonl(tmp_path / "rows.jsonl", T._rows(T.B))
    x86 = _train([str(runner_bin)], case.dir, data, tmp_path / "x86")
    arm = _train(["qemu-aarch64", "-L", SYSROOT, str(arm_bin)], case.dir, data, tmp_path / "arm")
    assert len(arm) == len(x86) == STEPS
    dloss = max(abs(a - b) for a, b in zip(arm, x86, strict=True))
    assert dloss <= TOL * max(map(abs, x86)), (arm, x86)
    assert x86[-1] < x86[0]  # it trained: not a comparison of two untouched adapters
    want = load_file(tmp_path / "x86" / "adapter_model.safetensors")
    got = load_file(tmp_path / "arm" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and want
    worst, identical = 0.0, True
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape and g.dtype == w.dtype, k
        diff = (g - w).abs().max().item()
        identical &= torch.equal(g, w)
        worst = max(worst, diff / max(w.abs().max().item(), 1e-30))
        assert diff <= TOL * w.abs().max().item(), (k, diff)
    cfg_x86 = json.loads((tmp_path / "x86" / "adapter_config.json").read_text())
    assert json.loads((tmp_path / "arm" / "adapter_config.json").read_text()) == cfg_x86
    # -s shows it: whether the two ISAs agreed bit for bit, else the worst relative drift.
    same = "bit-identical" if identical else f"max rel diff {worst:.2e}"
    print(f"{family}/{quant}: adapters {same}, losses differ by {dloss:.2e}")
