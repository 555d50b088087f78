"""A hard memory cap: run a command inside a Linux memory cgroup, and find the smallest cap in
which it completes.

A device's budget is a hard limit, not a high-water mark: a cap is what the process gets.
Linux enforces it with a memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, both
mounted on some machines; needs root or a delegated subtree). Swap is turned off inside the
group (`memory.swap.max = 0`, v1 `memory.memsw.limit_in_bytes` = the cap) so a capped run
cannot page its way past the limit. Page cache counts: the group is charged for the file pages
its process reads or maps (the model's weights, the programs), but clean pages are reclaimed
under the cap before anything is killed, so a cap below a run's peak usage (memory.max_usage_
in_bytes, v2 memory.peak) can still hold it; only anonymous memory, that cannot be dropped, has
to fit. The kernel's OOM killer ends a run that does not fit; `run_capped` reports that as
`killed` from the group's own oom_kill counter, not guessed from the exit status.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mesp.errors import MespError

CGROUP = Path("/sys/fs/cgroup")
MB = 1_000_000  # caps are given in MB (10^6 bytes), as the issue and a phone's spec sheet


@dataclass
class CappedRun:
    cap_bytes: int
    returncode: int
    killed: bool  # the kernel's OOM killer ended it inside the cap
    peak_bytes: int  # the group's peak charge (page cache included), 0 where not reported
    seconds: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed

    def why(self) -> str:
        """One line: what happened to the run under its cap."""
        cap = f"{self.cap_bytes / MB:.0f} MB"
        if self.killed:
            return f"killed by the memory cap ({cap}: the kernel's OOM killer, cgroup oom_kill)"
        if self.returncode != 0:
            last = (self.stderr.strip().splitlines() or ["?"])[-1]
            return f"exit {self.returncode} inside the {cap} cap: {last}"
        return f"completed inside the {cap} cap (group peak {self.peak_bytes / MB:.0f} MB)"


def memory_root() -> tuple[str, Path]:
    """('v2' | 'v1', the directory new groups are made in); a one-line MespError where this
    machine has no writable memory cgroup."""
    v2 = [CGROUP / "cgroup.controllers", CGROUP / "unified" / "cgroup.controllers"]
    for ctl in v2:
        if ctl.is_file() and "memory" in ctl.read_text().split() and os.access(ctl.parent, os.W_OK):
            return "v2", ctl.parent
    v1 = CGROUP / "memory"
    if (v1 / "memory.limit_in_bytes").is_file() and os.access(v1, os.W_OK):
        return "v1", v1
    raise MespError(
        "no writable memory cgroup here (needs Linux, cgroup v1 memory or v2 with the memory "
        "controller, and root or a delegated subtree): cannot enforce --memory-cap"
    )


def _setup(kind: str, d: Path, cap: int) -> None:
    if kind == "v2":
        (d / "memory.max").write_text(str(cap))
        if (d / "memory.swap.max").exists():
            (d / "memory.swap.max").write_text("0")
        return
    (d / "memory.limit_in_bytes").write_text(str(cap))
    if (d / "memory.memsw.limit_in_bytes").exists():  # limit + swap = limit: no swap
        (d / "memory.memsw.limit_in_bytes").write_text(str(cap))


def _read(d: Path, name: str) -> str:
    try:
        return (d / name).read_text()
    except OSError:
        return ""


def _counters(kind: str, d: Path) -> tuple[int, int]:
    """(oom kills in the group, peak bytes)."""
    events = _read(d, "memory.events" if kind == "v2" else "memory.oom_control").split()
    kills = int(events[events.index("oom_kill") + 1]) if "oom_kill" in events else 0
    peak = _read(d, "memory.peak" if kind == "v2" else "memory.max_usage_in_bytes").strip()
    return kills, int(peak) if peak.isdigit() else 0


def run_capped(
    argv: list[str],
    cap_bytes: int,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> CappedRun:
    """Run argv with every byte it and its children touch charged to a fresh group capped at
    cap_bytes; the group is removed afterwards."""
    if cap_bytes < 4 * MB:
        raise MespError(f"a memory cap of {cap_bytes / MB:.1f} MB is too small to start a process")
    kind, root = memory_root()
    d = root / f"mesp-cap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    procs = str(d / "cgroup.procs")

    def join() -> None:  # in the child, before exec: everything it maps is charged to d
        fd = os.open(procs, os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)

    try:
        _setup(kind, d, cap_bytes)
        t0 = time.perf_counter()
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
            preexec_fn=join,
        )  # fmt: skip
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise MespError(
                f"{argv[0]}: still running after {timeout:.0f} s under the cap"
            ) from None
        kills, peak = _counters(kind, d)
        return CappedRun(
            cap_bytes, p.returncode, kills > 0, peak, time.perf_counter() - t0, out, err
        )
    finally:
        for _ in range(50):  # the group empties as the kernel reaps the last task
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def find_cap(
    run: Callable[[int], CappedRun], low: int, high: int, step: int = 8 * MB
) -> tuple[int, list[CappedRun]]:
    """The smallest cap (to within `step`) under which `run(cap)` completes, by bisection
    between low (assumed to fail) and high (must complete: checked first). Returns it and
    every run made, in order."""
    first = run(high)
    tried = [first]
    if not first.ok:
        raise MespError(f"does not complete even at the upper cap: {first.why()}")
    while high - low > step:
        mid = (low + high) // 2
        r = run(mid)
        tried.append(r)
        if r.ok:
            high = mid
        elif r.killed:
            low = mid
        else:  # a failure that is not the cap's: bisecting would misread it
            raise MespError(r.why())
    return high, tried
