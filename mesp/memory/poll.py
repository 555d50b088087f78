"""A child process's anonymous memory, polled from outside: the check on what it reports itself.

The native runner reports its own peak RssAnon (a thread of its own reads it every millisecond).
`run_polled` starts a command and reads `/proc/PID/status` every `period` seconds (5 ms by
default, the issue's bar) until it exits, keeping the largest RssAnon and VmHWM it saw, so a
benchmark can print both figures side by side and say whether the reported one is honest.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.005


@dataclass
class Polled:
    returncode: int
    stdout: str
    stderr: str
    peak_anon_bytes: int  # largest RssAnon read from outside (0: never read, e.g. not Linux)
    samples: int  # how many reads succeeded
    period_s: float


def _anon(status: Path) -> int | None:
    """RssAnon of a live process in bytes; None once it is gone (or on a system without it)."""
    try:
        text = status.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return None


def run_polled(
    argv: list[str], timeout: float, period: float = POLL_S, env: dict[str, str] | None = None
) -> Polled:
    """Run `argv` to completion (killed after `timeout` s: subprocess.TimeoutExpired), polling
    its RssAnon every `period` seconds. stdout/stderr go through temp files, so a chatty child
    never blocks on a full pipe while we poll."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        status = Path(f"/proc/{proc.pid}/status")
        peak, samples, deadline = 0, 0, time.monotonic() + timeout
        while proc.poll() is None:
            anon = _anon(status)
            if anon is not None:
                peak, samples = max(peak, anon), samples + 1
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(period)
        out.seek(0)
        err.seek(0)
        return Polled(
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            peak,
            samples,
            period,
        )
