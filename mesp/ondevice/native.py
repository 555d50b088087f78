"""`mesp run-artifacts DIR --runtime native`: the C++ runner (runtime/, built by
scripts/build-ondevice) on the same flags as the Python drivers."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from mesp.errors import MespError

ENV = "MESP_NATIVE_RUNNER"


def binary() -> Path:
    """$MESP_NATIVE_RUNNER, else build/ondevice/mesp-runner beside the mesp package's checkout
    (where scripts/build-ondevice puts it)."""
    env = os.environ.get(ENV)
    p = Path(env) if env else Path(__file__).resolve().parents[2] / "build/ondevice/mesp-runner"
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise MespError(
            f"the native runner is not built ({p} missing): run scripts/build-ondevice, "
            f"or set {ENV}"
        )
    return p


def argv(ns: argparse.Namespace) -> list[str]:
    out = [
        str(binary()),
        str(ns.artifacts),
        "--data",
        str(ns.data),
        "--steps",
        str(ns.steps),
        "--lr",
        repr(float(ns.lr)),
        "--optimizer",
        ns.optimizer,
        "--weight-decay",
        repr(float(ns.weight_decay)),
        "--out",
        str(ns.out),
    ]
    if getattr(ns, "checkpoints_dir", None):
        out += ["--checkpoints-dir", str(ns.checkpoints_dir)]
    return out + (["--quiet"] if ns.quiet else [])


def run(ns: argparse.Namespace) -> int:
    """Run the binary in the foreground; its exit code is ours (its errors are already one line)."""
    try:
        return subprocess.run(argv(ns), check=False).returncode
    except OSError as e:
        raise MespError(f"cannot start the native runner: {e.strerror or e}") from None


__all__ = ["ENV", "argv", "binary", "run"]
