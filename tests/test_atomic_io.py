"""mesp.atomic_io: a finished write is whole and has the mode of a plain open()."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mesp.atomic_io import atomic_write
from mesp.errors import MespError


def test_written_file_has_the_umask_mode_not_mkstemps(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.bin", lambda p: Path(p).write_bytes(b"x" * 10))
        plain = tmp_path / "plain.bin"
        plain.write_bytes(b"")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "a.bin").stat().st_mode)
    assert mode == stat.S_IMODE(plain.stat().st_mode) == 0o644
    assert (tmp_path / "a.bin").read_bytes() == b"x" * 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "plain.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "a.bin"
    target.write_bytes(b"old")

    def fail(p: str) -> None:
        Path(p).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(MespError, match="could not save .No space left on device"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["a.bin"]
