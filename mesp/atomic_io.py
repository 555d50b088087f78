"""Crash-safe file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from mesp.errors import MespError


def _reason(e: Exception) -> str:
    """One line: the OS's words for an OSError; safetensors' own message (it wraps the
    same errno, e.g. 'No space left on device (os error 28)') otherwise."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp_path)` into a temp file in the same directory, fsync it, rename it over
    `path`, fsync the directory (so the rename itself survives a power cut). The file gets
    the mode a plain open() would give it (mkstemp's 0600 would hide an exported model or
    adapter from the other users of a shared machine, or from a server such as Ollama)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        # safetensors' writer raises SafetensorError (not an OSError) on ENOSPC/EFBIG/EACCES
        raise MespError(f"{path}: could not save ({_reason(e)})") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
