"""Session fixtures shared by the on-device tests: the native runner's build and the tiny
ExecuTorch exports (lowering a model takes minutes on 2 cores: each is made once per session).
Under pytest-xdist (scripts/test runs two workers) the workers share them: the runner is built
under a lock, the exports go to one root that every worker reads, and each worker's torch takes
its share of the cores."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
NATIVE_BIN = ROOT / "build" / "ondevice" / "mesp-runner"
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:  # two workers each with every core's threads would spin against each other
    SHARE = max(1, (os.cpu_count() or 1) // WORKERS)
    torch.set_num_threads(SHARE)
    # and so would the processes a test starts (the CLI, the demo, the native runner): measured,
    # the demo beside one busy core took 60 s with two threads and 36 s with one
    os.environ["OMP_NUM_THREADS"] = str(SHARE)


def executorch_dir() -> Path | None:
    spec = importlib.util.find_spec("executorch")
    for d in (spec.submodule_search_locations or []) if spec else []:
        if (Path(d) / "include" / "executorch").is_dir():
            return Path(d)
    return None


@pytest.fixture(scope="session")
def runner_bin() -> Path:
    """scripts/build-ondevice, once per session, against this interpreter's venv."""
    if executorch_dir() is None:
        pytest.skip("executorch (with its C++ headers and libraries) is not installed")
    if shutil.which("cmake") is None and not (Path(sys.prefix) / "bin" / "cmake").exists():
        pytest.skip("cmake is not installed")
    env = {**os.environ, "MESP_VENV": sys.prefix}
    (ROOT / "build").mkdir(exist_ok=True)
    with open(ROOT / "build" / "ondevice.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time in build/ondevice
        r = subprocess.run(
            [str(ROOT / "scripts" / "build-ondevice")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
    assert r.returncode == 0, f"build-ondevice failed:\n{r.stdout}\n{r.stderr}"
    assert NATIVE_BIN.is_file()
    return NATIVE_BIN


@pytest.fixture(scope="session")
def et_cases(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """get(family, quant) -> an exported tiny model (tests.et_cases.EtCase), made on first use."""
    pytest.importorskip("executorch")
    from tests.et_cases import EtCase, prefetch

    if WORKERS > 1:  # the session's base folder is per worker; its parent is the run's
        root = tmp_path_factory.getbasetemp().parent / "et"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("et")
    made: dict = {}

    def get(family: str, quant: str, also: list[tuple[str, str]] | None = None) -> EtCase:
        """The case; `also`: cases the caller will want next, exported now in parallel."""
        if (family, quant) not in made:
            prefetch([(family, quant), *(also or [])], root)
            made[family, quant] = EtCase(family, quant, root)
        return made[family, quant]

    return get
