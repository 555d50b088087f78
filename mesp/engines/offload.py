"""Where block-boundary checkpoints live between forward and backward.

`none`: in memory, as tensors. `cpu`: in host memory (a no-op when computing on the CPU; on an
accelerator it moves them off the device). `disk`: one raw file in a private temporary
directory; backward reads each checkpoint back while a background thread prefetches the next
one, so peak memory no longer grows with depth. The directory is removed on every exit path
that Python sees (normal return, exception, KeyboardInterrupt).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from mesp.errors import MespError

OFFLOAD_MODES = ("none", "cpu", "disk")
log = logging.getLogger("mesp")


class CheckpointStore:
    def __init__(self, mode: str, directory: str | None = None, fallback: bool = False) -> None:
        if mode not in OFFLOAD_MODES:
            raise MespError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}")
        self.mode, self.fallback = mode, fallback
        self.mem: dict[int, Tensor] = {}
        self.meta: dict[int, tuple[int, torch.Size, torch.dtype, torch.device]] = {}
        self._dir = self._fd = None
        self._end = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, tuple[Tensor, Future[None]]] = {}
        if mode == "disk":
            try:
                self._dir = tempfile.mkdtemp(prefix="mesp-ckpt-", dir=directory)
                self._fd = os.open(
                    os.path.join(self._dir, "checkpoints.bin"), os.O_RDWR | os.O_CREAT, 0o600
                )
            except OSError as e:
                self._fail(
                    f"cannot create an offload file in {directory or tempfile.gettempdir()}"
                    f" ({e.strerror or e})"
                )
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mesp-prefetch")

    def _fail(self, msg: str) -> None:
        if not self.fallback:
            self.close()
            raise MespError(f"{msg}; free space or pass --offload-fallback to keep them in memory")
        log.warning("%s; keeping checkpoints in memory", msg)
        for i in list(self.meta):  # what already reached the disk comes back first
            self.mem[i] = self.pop(i)
        self.close()
        self.mode = "none"

    def put(self, i: int, t: Tensor) -> None:
        if self.mode == "none":
            self.mem[i] = t
        elif self.mode == "cpu":
            self.mem[i] = t if t.is_meta else t.to("cpu", non_blocking=True)
            self.meta[i] = (0, t.shape, t.dtype, t.device)
        elif t.is_meta:  # memory accounting only: the tensor leaves memory, nothing is written
            self.meta[i] = (self._end, t.shape, t.dtype, t.device)
            self._end += t.numel() * t.element_size()
        else:
            raw = t.detach().contiguous().cpu().view(torch.uint8).numpy()
            try:
                n = os.pwrite(self._fd, memoryview(raw), self._end)  # type: ignore[arg-type]
                if n != raw.nbytes:
                    raise OSError(28, "short write (disk full?)")
            except OSError as e:
                self._fail(f"offload write failed ({e.strerror or e})")
                self.mem[i] = t
                return
            self.meta[i] = (self._end, t.shape, t.dtype, t.device)
            self._end += raw.nbytes

    def _alloc(self, i: int) -> Tensor:
        """The buffer checkpoint i is read into, made on the calling (main) thread so that
        memory accounting, which sees one thread's ops, sees it."""
        _, shape, dtype, device = self.meta[i]
        return torch.empty(shape, dtype=dtype, device="meta" if device.type == "meta" else "cpu")

    def _fill(self, i: int, buf: Tensor) -> None:
        """Read checkpoint i's bytes into buf (any thread; no tensor is created here)."""
        if buf.is_meta:
            return
        raw = buf.view(-1).view(torch.uint8).numpy()
        got = os.preadv(self._fd, [raw], self.meta[i][0])  # type: ignore[arg-type]
        if got != raw.nbytes:
            raise MespError(f"offload file {self._dir}: short read of checkpoint {i}")

    def prefetch(self, i: int) -> None:
        """Start reading checkpoint i in the background (disk mode only)."""
        if self.mode == "disk" and i in self.meta and i not in self._pending and self._pool:
            buf = self._alloc(i)
            self._pending[i] = (buf, self._pool.submit(self._fill, i, buf))

    def pop(self, i: int) -> Tensor:
        if i in self.mem:
            t = self.mem.pop(i)
            return t.to(self.meta.pop(i)[3]) if self.mode == "cpu" else t
        pending = self._pending.pop(i, None)
        if pending is None:
            buf = self._alloc(i)
            self._fill(i, buf)
        else:
            buf = pending[0]
            pending[1].result()
        return buf.to(self.meta.pop(i)[3])

    def close(self) -> None:
        for _, f in self._pending.values():
            f.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
