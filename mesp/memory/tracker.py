"""Exact live-tensor byte accounting via a dispatch mode, so peak memory is testable on CPU.

Every aten op run under the mode (forward, autograd backward, no_grad) is seen. An output whose
storage is not already known and not an input's storage is a new allocation. A free is detected
with a weakref on the storage's Python object: torch preserves that object for as long as the
C++ StorageImpl lives (one wrapper per storage, checked at import), so its weakref callback fires
exactly when the last tensor, view, saved-for-backward ref or C++ owner drops the storage.
Memory allocated inside a kernel and freed before it returns is invisible by design.
Meta tensors are counted like any other: run a step on the meta device and the tracker reports
the bytes it would hold, without the arithmetic (`mesp bench ladder`; a test holds meta == CPU).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TensorGroup = Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    """Tensors inside an op's args or result (nested lists/tuples/dicts); cheaper than pytree."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _storage(obj: object) -> torch.UntypedStorage | None:
    """The storage behind a dense tensor (meta included); None for non-tensors, sparse or
    storage-less."""
    if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided:
        return None
    try:
        return obj.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _check_storage_preservation() -> None:
    """Refuse to run if torch stops preserving storage wrappers: frees would be miscounted."""
    t = torch.empty(1)
    first = id(t.untyped_storage())
    if id(t.untyped_storage()) != first or t.untyped_storage() is not t[:].untyped_storage():
        raise RuntimeError("torch no longer preserves UntypedStorage wrappers; tracker invalid")


_check_storage_preservation()


_LIFT_OPS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default)


class _Entry:
    """One tracked storage: a unique id (addresses get reused), its size and its weakref."""

    __slots__ = ("nbytes", "ref", "uid")

    def __init__(self, uid: int, nbytes: int, ref: weakref.ref) -> None:
        self.uid, self.nbytes, self.ref = uid, nbytes, ref


class LiveTensorTracker(TorchDispatchMode):
    """Current and peak bytes of live tensor storages, plus what was live at the peak."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self._device = device  # device type to count ("cpu", "cuda"); None counts all
        self._lock = threading.RLock()  # autograd may run CUDA backward in a worker thread
        self._uids = itertools.count()
        self._live: dict[int, _Entry] = {}  # StorageImpl address -> entry
        self._category: dict[int, str] = {}  # uid -> category given to register()
        self._peak_live: dict[int, int] | None = {}  # uid -> bytes; None: current IS the peak
        self.current_bytes = 0
        self.peak_bytes = 0

    # -- accounting -------------------------------------------------------------------------
    def _grow(self, n: int) -> None:
        self.current_bytes += n
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_live = None

    def _shrink(self, n: int) -> None:
        if self._peak_live is None and n:  # leaving the peak: freeze what was live there
            self._peak_live = {e.uid: e.nbytes for e in self._live.values()}
        self.current_bytes -= n

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry.ref is ref:
                self._shrink(entry.nbytes)  # snapshot (if at peak) still includes this entry
                del self._live[key]

    def _track(self, st: torch.UntypedStorage) -> _Entry | None:
        """Count a new storage, or re-size a known one (resize_, out= ops)."""
        if self._device is not None and st.device.type != self._device:
            return None
        key, nbytes = st._cdata, st.nbytes()
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry.ref() is not st:  # address reused, free pending
                self._on_free(key, entry.ref)
                entry = None
            if entry is None:
                ref = weakref.ref(st, lambda r, k=key: self._on_free(k, r))
                entry = self._live[key] = _Entry(next(self._uids), nbytes, ref)
                self._grow(nbytes)
            elif nbytes > entry.nbytes:
                self._grow(nbytes - entry.nbytes)
                entry.nbytes = nbytes
            elif nbytes < entry.nbytes:
                self._shrink(entry.nbytes - nbytes)
                entry.nbytes = nbytes
            return entry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: set[int] | None = None  # built lazily: most outputs are views of known storages
        for leaf in _tensors(out):
            st = _storage(leaf)
            if st is None:
                continue
            entry = self._live.get(st._cdata)
            if entry is None or entry.ref() is not st:
                if inputs is None:
                    found = map(_storage, _tensors((args, kwargs)))
                    inputs = {s._cdata for s in found if s is not None}
                # view / in-place on an untracked pre-existing tensor; but lift_fresh's input is
                # the fresh tensor torch.tensor()/as_tensor() built outside dispatch: new memory
                if st._cdata in inputs and func not in _LIFT_OPS:
                    continue
            self._track(st)
        return out

    # -- public API ---------------------------------------------------------------------------
    def register(self, tensors: Iterable[torch.Tensor], category: str = "weights") -> int:
        """Count tensors allocated before the mode (weights, LoRA params); returns bytes added."""
        before = self.current_bytes
        for t in tensors:
            st = _storage(t)
            entry = None if st is None else self._track(st)
            if entry is not None:
                self._category[entry.uid] = category
        return self.current_bytes - before

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        with self._lock:
            self.peak_bytes = self.current_bytes
            self._peak_live = None

    def live_at_peak(self) -> dict[int, int]:
        """uid -> bytes of every storage live at the moment of the peak."""
        with self._lock:
            if self._peak_live is None:
                return {e.uid: e.nbytes for e in self._live.values()}
            return dict(self._peak_live)

    def breakdown(self, **groups: Iterable[torch.Tensor]) -> dict[str, int]:
        """Split the peak: storages of the given tensors (e.g. weights=, adapter=) go to that
        group, else to their register() category, else to 'working'. Groups are matched by
        storage identity, so pass .grad and optimizer state too; first group named wins."""
        peak = self.live_at_peak()
        owner: dict[int, str] = {}
        with self._lock:
            for name, tensors in groups.items():
                for t in tensors:
                    st = _storage(t)
                    entry = None if st is None else self._live.get(st._cdata)
                    if entry is not None and entry.ref() is st:
                        owner.setdefault(entry.uid, name)
        out = {"weights": 0, "adapter": 0, "working": 0}
        out.update({name: 0 for name in groups})
        for uid, nbytes in peak.items():
            name = owner.get(uid) or self._category.get(uid, "working")
            out[name] = out.get(name, 0) + nbytes
        out["total"] = sum(peak.values())
        return out


def adapter_tensors(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
) -> list[torch.Tensor]:
    """LoRA params, their .grad and optimizer state: everything the 'adapter' category owns."""
    out: list[torch.Tensor] = []
    for p in params:
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _resolve(group: TensorGroup) -> list[torch.Tensor]:
    return list(group() if callable(group) else group)


def measure_peak(
    fn: Callable[[], object],
    *,
    weights: TensorGroup = (),
    adapter: TensorGroup = (),
    device: str | None = None,
) -> dict[str, int]:
    """Run fn under a tracker and return the peak split into weights/adapter/working/total.
    A callable group is re-evaluated after fn, so grads and optimizer state made by fn count."""
    tracker = LiveTensorTracker(device)
    tracker.register(_resolve(weights), "weights")
    tracker.register(_resolve(adapter), "adapter")
    with tracker:
        fn()
    return tracker.breakdown(weights=_resolve(weights), adapter=_resolve(adapter))


__all__ = ["LiveTensorTracker", "adapter_tensors", "measure_peak"]
