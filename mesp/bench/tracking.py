"""What a benchmark child wraps its step in: the exact tracker with a per-op timeline and the
origin of every allocation, and the PEFT baseline's fp32 matmul substitute."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mesp.memory.tracker import LiveTensorTracker


class TimelineTracker(LiveTensorTracker):
    """The exact tracker plus a sample of live bytes after every op, and for each allocation
    the op, shape and the innermost non-torch source line that made it: what the peak is."""

    def __init__(self, timeline: bool) -> None:
        super().__init__()
        self.samples: list[int] | None = [] if timeline else None
        self._new: dict[int, Any] = {}  # uid -> entry, allocations of the op in flight
        self.origin: dict[int, str] = {}  # uid -> "site op shape dtype"

    def _track(self, st: torch.UntypedStorage) -> Any:
        known = self._live.get(st._cdata)
        entry = super()._track(st)
        if entry is not None and entry is not known:
            self._new[entry.uid] = entry
        return entry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        self._new.clear()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._new:
            site = _site()
            for leaf in torch.utils._pytree.tree_leaves(out):
                if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
                    continue
                entry = self._live.get(leaf.untyped_storage()._cdata)
                if entry is not None and entry.uid in self._new:
                    shape = "x".join(map(str, leaf.shape))
                    self.origin[entry.uid] = f"{site} {func.__name__} {shape} {leaf.dtype}"
        if self.samples is not None:
            self.samples.append(self.current_bytes)
        return out

    def peak_composition(self, top: int = 12) -> list[dict[str, Any]]:
        """Working tensors live at the peak, grouped by where they were made, largest first."""
        groups: dict[str, list[int]] = {}
        for uid, nbytes in self.live_at_peak().items():
            if uid in self._category:  # registered weights / adapter
                continue
            key = self.origin.get(uid, "(unknown)")
            acc = groups.setdefault(key, [0, 0])
            acc[0] += nbytes
            acc[1] += 1
        rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"what": k, "bytes": b, "count": n} for k, (b, n) in rows]

    def downsampled(self, points: int, base: int) -> list[int]:
        """At most `points` samples of (live − base) bytes; max per bucket keeps the peak."""
        s = [x - base for x in self.samples or []]
        if len(s) <= points:
            return s
        step = -(-len(s) // points)
        return [max(s[i : i + step]) for i in range(0, len(s), step)]


_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_INPLACE = {
    _aten.addmm_.default: _aten.addmm.default,
    _aten.baddbmm_.default: _aten.baddbmm.default,
}


class Fp32Matmul(TorchDispatchMode):
    """For the PEFT baseline only: its bf16/fp16 CPU matmuls computed in fp32 and rounded back,
    what mesp itself does in mesp/ops/matmul.py where the CPU has no bf16 GEMM (torch's fallback
    is 5-160x slower than fp32 there), so that both sides of a comparison time an fp32 GEMM.
    Sits below the tracker, so the exact peak sees bf16 in and out; RSS sees the fp32 copies."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _MATMULS or func in _INPLACE:
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            if all(t.dtype in (torch.bfloat16, torch.float16) and not t.is_cuda for t in ts):
                up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                if func in _MATMULS:
                    return func(*up, **kwargs).to(ts[0].dtype)
                return args[0].copy_(_INPLACE[func](*up, **kwargs))
        return func(*args, **kwargs)


# the child's own frames (its step closures) are not the origin of what they call
_DIR = os.path.dirname(os.path.abspath(__file__))
_HERE = {os.path.join(_DIR, "tracking.py"), os.path.join(_DIR, "child.py")}


def _site() -> str:
    """file:line(function) of the innermost frame outside torch and this module."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        ours = os.path.abspath(path) in _HERE
        if not ours and f"{os.sep}torch{os.sep}" not in path and "memory_tracker" not in path:
            return f"{os.path.basename(path)}:{f.f_lineno}({f.f_code.co_name})"
        f = f.f_back
    return "(unknown)"


__all__ = ["Fp32Matmul", "TimelineTracker"]
