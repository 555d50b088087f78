"""A private spill file: tensors appended as raw bytes, read back (optionally in a background
thread) into buffers the caller made. Used for block checkpoints (`--offload disk`) and for
streamed block weights (`--stream-weights`).

The file lives in a fresh directory (mkdtemp, mode 0700) that `close()` removes; callers close
on every exit path they see, and an atexit hook catches the rest. Reads fill tensors that were
allocated on the calling thread, so memory accounting (which sees one thread's ops) sees them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from mesp.errors import MespError


def check_spill_dir(directory: str | None, flag: str) -> None:
    """The spill files (disk checkpoints, streamed weights) go in `directory` (default: the
    temporary directory): fail now, before any output is written, not at the first step."""
    d = directory or tempfile.gettempdir()
    try:
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise MespError(f"{flag}: cannot write spill files in {d} ({e.strerror or e})") from None


class SpillFile:
    def __init__(self, directory: str | None, prefix: str) -> None:
        """Raises OSError when the directory or file cannot be created."""
        self._dir: str | None = tempfile.mkdtemp(prefix=prefix, dir=directory)
        self._fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.end = 0
        try:
            self._fd = os.open(os.path.join(self._dir, "spill.bin"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=prefix.strip("-"))
        atexit.register(self.close)

    @property
    def path(self) -> str | None:
        return self._dir

    def append(self, t: Tensor) -> int:
        """Write t's bytes at the end; returns their offset. OSError when the disk refuses."""
        raw = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
        if self._fd is None:
            raise OSError(9, "spill file closed")
        if os.pwrite(self._fd, memoryview(raw), self.end) != raw.nbytes:  # type: ignore[arg-type]
            raise OSError(28, "short write (disk full?)")
        off, self.end = self.end, self.end + raw.nbytes
        return off

    def read_into(self, offset: int, buf: Tensor) -> None:
        """Fill buf (a contiguous CPU tensor) with the bytes at offset. Any thread."""
        raw = buf.view(-1).view(torch.uint8).numpy()
        if self._fd is None or os.preadv(self._fd, [raw], offset) != raw.nbytes:  # type: ignore[arg-type]
            raise OSError(5, f"short read in {self._dir}")

    def submit(self, fn: Callable[..., None], *args: object) -> Future[None]:
        """Run fn(*args) on the background reader thread."""
        if self._pool is None:
            raise OSError(9, "spill file closed")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
