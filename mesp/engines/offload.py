"""Where block-boundary checkpoints live between forward and backward.

`none`: in memory, as tensors. `cpu`: in host memory (a no-op when computing on the CPU; on an
accelerator it moves them off the device). `disk`: one raw file in a private temporary
directory; backward reads each checkpoint back while a background thread prefetches the next
one, so peak memory no longer grows with depth. The directory is removed on every exit path
that Python sees (normal return, exception, KeyboardInterrupt).
"""

from __future__ import annotations

import logging
import tempfile
from concurrent.futures import Future

import torch
from torch import Tensor

from mesp.engines.spill import SpillFile
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
        self._file: SpillFile | None = None
        self._meta_end = 0  # offsets of meta-device checkpoints (nothing is written)
        self._pending: dict[int, tuple[Tensor, Future[None]]] = {}
        if mode == "disk":
            try:
                self._file = SpillFile(directory, "mesp-ckpt-")
            except OSError as e:
                self._fail(
                    f"cannot create an offload file in {directory or tempfile.gettempdir()}"
                    f" ({e.strerror or e})"
                )

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
            self.meta[i] = (self._meta_end, t.shape, t.dtype, t.device)
            self._meta_end += t.numel() * t.element_size()
        else:
            assert self._file is not None
            try:
                off = self._file.append(t)
            except OSError as e:
                self._fail(f"offload write failed ({e.strerror or e})")
                self.mem[i] = t
                return
            self.meta[i] = (off, t.shape, t.dtype, t.device)

    def _alloc(self, i: int) -> Tensor:
        """The buffer checkpoint i is read into, made on the calling (main) thread so that
        memory accounting, which sees one thread's ops, sees it."""
        _, shape, dtype, device = self.meta[i]
        return torch.empty(shape, dtype=dtype, device="meta" if device.type == "meta" else "cpu")

    def _fill(self, i: int, buf: Tensor) -> None:
        """Read checkpoint i's bytes into buf (any thread; no tensor is created here)."""
        if buf.is_meta:
            return
        assert self._file is not None
        try:
            self._file.read_into(self.meta[i][0], buf)
        except OSError as e:
            raise MespError(f"offload file: cannot read checkpoint {i} back ({e})") from None

    def prefetch(self, i: int) -> None:
        """Start reading checkpoint i in the background (disk mode only)."""
        if self.mode == "disk" and i in self.meta and i not in self._pending and self._file:
            buf = self._alloc(i)
            self._pending[i] = (buf, self._file.submit(self._fill, i, buf))

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
        self._pending.clear()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
