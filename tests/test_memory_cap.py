"""The hard memory cap (mesp/memory/cgroup.py): a process over its cap is killed and reported so,
one under it completes, and the bisection finds the smallest cap to within its step. Needs a
writable memory cgroup (root on Linux; CI runs as root): skipped, saying why, elsewhere."""

from __future__ import annotations

import sys

import pytest

from mesp.errors import MespError
from mesp.memory.cgroup import MB, find_cap, memory_root, run_capped

try:
    memory_root()
    WHY = ""
except MespError as e:
    WHY = str(e)
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY)


def _hog(mb: int) -> list[str]:
    """A Python that writes mb MB of anonymous memory (every page touched), then exits 0."""
    return [sys.executable, "-S", "-c", f"b = b'\\x01' * ({mb} * 1000 * 1000); print(len(b))"]


def test_over_the_cap_is_killed_and_under_it_completes() -> None:
    over = run_capped(_hog(200), 100 * MB, timeout=60)
    assert over.killed and not over.ok, over
    assert "killed by the memory cap (100 MB" in over.why()
    under = run_capped(_hog(50), 200 * MB, timeout=60)
    assert under.ok, under.why()
    assert under.stdout.strip() == str(50 * MB)
    assert 50 * MB <= under.peak_bytes <= 200 * MB  # the group's own charge


def test_find_cap_brackets_the_need() -> None:
    cap, runs = find_cap(lambda c: run_capped(_hog(120), c, timeout=60), 8 * MB, 512 * MB)
    # 120 MB written + the interpreter (a few MB): found to within the 8 MB step
    assert 120 * MB < cap <= 170 * MB, cap / MB
    assert runs[0].ok and any(r.killed for r in runs)
    assert not run_capped(_hog(120), cap - 16 * MB, timeout=60).ok


def test_refusals_are_one_line() -> None:
    with pytest.raises(MespError, match="too small"):
        run_capped(_hog(1), 1 * MB, timeout=10)
    with pytest.raises(MespError, match="does not complete even at the upper cap"):
        find_cap(lambda c: run_capped(_hog(300), c, timeout=60), 8 * MB, 64 * MB)
    failing = [sys.executable, "-S", "-c", "raise SystemExit(3)"]
    r = run_capped(failing, 64 * MB, timeout=10)
    assert r.returncode == 3 and not r.killed and r.why().startswith("exit 3 inside the 64 MB")
