"""Frozen block weights streamed from disk (`--stream-weights`): only the blocks in use are in
memory. The companion paper's lowest rungs keep the base weights off the device the same way.

On attach, every block's frozen buffers (packed words, scales, biases, norm weights, q/k/v
biases) are written to one file in a temporary directory and replaced by empty placeholders;
LoRA parameters stay put. A block's buffers come back on `load(i)` (read in a background
thread when `prefetch(i)` ran first: the destination tensors are made on the calling thread, so
memory accounting sees them) and go again on `release(i)`. A forward pre-hook loads a block
that is not resident and a forward hook releases it unless it is pinned, so any caller
(evaluation, generation) works unchanged; the engine pins around a block's recompute + backward
and prefetches the next block. The directory is removed on `close()` and at interpreter exit.

On the meta device (memory accounting) nothing is written: released buffers are dropped and
loads allocate meta tensors of the same shapes.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import Future

import torch
from torch import Tensor, nn

from mesp.engines.spill import SpillFile
from mesp.errors import MespError
from mesp.models.transformer import CausalLM

Entry = tuple[nn.Module, str, int, torch.Size, torch.dtype]  # module, buffer, offset, shape, dtype


class BlockWeightStream:
    def __init__(self, model: CausalLM, directory: str | None = None) -> None:
        self.model = model
        self.entries: list[list[Entry]] = []
        self.pinned: set[int] = set()
        self._pending: dict[int, tuple[list[Tensor], Future[None]]] = {}
        self._meta = next(model.buffers()).is_meta
        self._file: SpillFile | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        try:
            if not self._meta:
                self._file = SpillFile(directory, "mesp-weights-")
            end = 0
            for block in model.layers:
                entries: list[Entry] = []
                for mod in block.modules():
                    for name, buf in list(mod._buffers.items()):
                        if buf is None:
                            continue
                        off = end if self._file is None else self._file.append(buf)
                        end = off + buf.numel() * buf.element_size()
                        entries.append((mod, name, off, buf.shape, buf.dtype))
                self.entries.append(entries)
        except OSError as e:
            self.close(restore=False)
            raise MespError(
                f"cannot write block weights to {directory or tempfile.gettempdir()} "
                f"({e.strerror or e}); free space or drop --stream-weights"
            ) from None
        for i, block in enumerate(model.layers):
            self._drop(i)
            self._hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: self.load(i)))
            self._hooks.append(block.register_forward_hook(lambda m, a, o, i=i: self._after(i)))

    def _drop(self, i: int) -> None:
        for mod, name, _, _, dtype in self.entries[i]:
            mod._buffers[name] = torch.empty(0, dtype=dtype, device=self._device)

    @property
    def _device(self) -> str:
        return "meta" if self._meta else "cpu"

    def resident(self, i: int) -> bool:
        mod, name, _, shape, _ = self.entries[i][0]
        return mod._buffers[name].shape == shape

    def _alloc(self, i: int) -> list[Tensor]:
        return [torch.empty(s, dtype=d, device=self._device) for _, _, _, s, d in self.entries[i]]

    def _fill(self, i: int, bufs: list[Tensor]) -> None:
        if self._file is None:
            return
        try:
            for (_, _, off, _, _), t in zip(self.entries[i], bufs, strict=True):
                self._file.read_into(off, t)
        except OSError as e:
            raise MespError(f"weight stream: cannot read block {i} back ({e})") from None

    def prefetch(self, i: int) -> None:
        if 0 <= i < len(self.entries) and i not in self._pending and not self.resident(i):
            bufs = self._alloc(i)
            if self._file is None:
                self._pending[i] = (bufs, _done())
            else:
                self._pending[i] = (bufs, self._file.submit(self._fill, i, bufs))

    def load(self, i: int) -> None:
        if self.resident(i):
            return
        pending = self._pending.pop(i, None)
        if pending is None:
            bufs = self._alloc(i)
            self._fill(i, bufs)
        else:
            bufs = pending[0]
            pending[1].result()
        for (mod, name, _, _, _), t in zip(self.entries[i], bufs, strict=True):
            mod._buffers[name] = t

    def _after(self, i: int) -> None:
        if i not in self.pinned:
            self._drop(i)

    def pin(self, i: int) -> None:
        self.pinned.add(i)
        self.load(i)

    def unpin(self, i: int) -> None:
        self.pinned.discard(i)
        self._drop(i)

    def close(self, restore: bool = True) -> None:
        """Stop streaming: with `restore`, every block's weights come back into memory first;
        the file and its directory are removed either way."""
        if restore and (self._file is not None or self._meta):
            for i in range(len(self.entries)):
                self.load(i)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._pending.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f
