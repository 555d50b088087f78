"""How a lowered program holds its activations: the order of its ops and their arena offsets.

The block backward's arena is the largest piece of the native runner's memory, and two choices
of executorch 1.5.1 left it above what the program ever holds at once (real Qwen2.5-Coder-0.5B,
seq 256: 36.5 MiB planned where at most 31.7 MiB is live at any op):
  - after partitioning, the graph is put back in *a* topological order, not a frugal one: the
    MLP's backward product could run before its recompute, holding (tokens × 4864) tensors
    side by side that the engine's order never does. `order_for_memory` re-orders the call
    nodes greedily (run next the ready op that adds the least, net of what it frees) and keeps
    the new order only where its peak is lower. Any topological order computes the same values:
    each op reads the same inputs.
  - the planner's greedy places tensors in shared objects by size and leaves holes; `first_fit`
    places each tensor, largest first, at the lowest offset free over its whole lifetime.
    `planning_pass` runs both and keeps the smaller arena (ExecuTorch's own suite picks it).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
from torch.fx import GraphModule, Node


def _numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape:
        if isinstance(d, int):
            n *= d
            continue
        try:  # a dynamic dim: its upper bound, as the planner sizes it
            n *= int(d.node.shape_env.bound_sympy(d.node.expr).upper)
        except Exception:  # an unbounded or unhinted symbol: count it as 1
            n *= int(d.node.hint or 1) if hasattr(d, "node") else 1
    return n


def _bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return _numel(v) * v.element_size()
    if isinstance(v, list | tuple):
        return sum(_bytes(x) for x in v)
    return 0


def _is_view(n: Node) -> bool:  # the emitter makes these views of their input's memory
    return getattr(n.target, "__name__", None) == "aten.view_copy.default"


class _Bytes:
    """The size model of a graph's call nodes: the bytes each output holds, a reshape holding
    none (it reads its input's memory, which its readers keep alive), a tuple none (its parts,
    the getitems, hold them)."""

    def __init__(self, body: list[Node]) -> None:
        self.idx = {n: i for i, n in enumerate(body)}
        self.root: dict[Node, Node] = {}
        self.size: dict[Node, int] = {}
        for n in body:
            src = n.all_input_nodes[0] if _is_view(n) and n.all_input_nodes else None
            self.root[n] = self.root.get(src, src) if src in self.idx else n
            tuple_ = bool(n.users) and all(u.target is operator.getitem for u in n.users)
            self.size[n] = 0 if self.root[n] is not n or tuple_ else _bytes(n.meta.get("val"))

    def reads(self, n: Node) -> set[Node]:
        """The memory n's run reads (a reshape reads none: it only names its input's)."""
        if _is_view(n):
            return set()
        return {self.root[a] for a in n.all_input_nodes if a in self.idx}

    def adds(self, n: Node) -> int:
        return self.size[n] + sum(self.size[u] for u in n.users if u.target is operator.getitem)


def _peak(order: list[Node], m: _Bytes) -> int:
    """The most bytes held at once when the nodes run in `order` (memory no node reads again is
    freed after its last reader; a program output is held to the end)."""
    last: dict[Node, int] = {}
    for i, n in enumerate(order):
        for a in m.reads(n):
            last[a] = i
    live = peak = 0
    for i, n in enumerate(order):
        live += m.size[n]
        peak = max(peak, live)
        live -= sum(m.size[a] for a in m.reads(n) if last[a] == i)
    return peak


def _greedy(body: list[Node], m: _Bytes) -> list[Node]:
    left: dict[Node, int] = defaultdict(int)  # readers of each memory not yet run
    for n in body:
        for a in m.reads(n):
            left[a] += 1
    waiting = {n: sum(1 for a in set(n.all_input_nodes) if a in m.idx) for n in body}
    ready = [n for n in body if waiting[n] == 0]
    order: list[Node] = []

    def cost(n: Node) -> tuple[int, int]:  # bytes it adds, net of what it frees
        freed = sum(m.size[a] for a in m.reads(n) if left[a] == 1)
        return m.adds(n) - freed, m.idx[n]

    while ready:
        free = [n for n in ready if n.target is operator.getitem or _is_view(n)]  # names: now
        n = min(free, key=m.idx.__getitem__) if free else min(ready, key=cost)
        ready.remove(n)
        order.append(n)
        for a in m.reads(n):
            left[a] -= 1
        for u in n.users:
            if u in waiting:
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready.append(u)
    return order


def order_for_memory(gm: GraphModule) -> tuple[int, int]:
    """Re-order gm's call nodes (see the module doc) where that lowers their peak; returns the
    peak in bytes of the old and the kept order."""
    nodes = list(gm.graph.nodes)
    body = [n for n in nodes if n.op == "call_function"]
    if not body:
        return 0, 0
    m = _Bytes(body)
    before = _peak(body, m)
    order = _greedy(body, m)
    after = _peak(order, m)
    if len(order) != len(body) or after >= before:
        return before, before
    anchor = max((n for n in nodes if n.op in ("placeholder", "get_attr")), key=nodes.index)
    for n in order:
        anchor.append(n)
        anchor = n
    gm.graph.lint()
    gm.recompile()
    return before, after


def first_fit(
    alignment: int, specs: Any, graph_module: Any, graph_signature: Any, extra_padding: int = 0
) -> Any:
    """An ExecuTorch memory-planning algorithm: every tensor, largest first, at the lowest
    offset of its memory id that no tensor alive at the same time uses."""
    from executorch.exir.memory_planning import (
        AllocationSpec,
        MemoryAlgoResult,
        SharedObject,
        SpecAllocResult,
        _compute_total_sizes,
        _resolve_storage_base_specs,
    )

    result = MemoryAlgoResult({}, [])
    placed: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    arena: dict[int, SharedObject] = {}
    spec2obj: dict[Any, SharedObject] = {}
    views = []  # tensors that live inside another's storage: placed with it
    for spec in sorted(specs, key=lambda s: (-s.allocated_memory, s.lifetime[0])):
        mem_id = 1 if spec.mem_id is None else spec.mem_id
        result.spec_dict[spec] = SpecAllocResult(mem_id, 0, 0)
        spec.realign(alignment)
        if spec.storage_base is not None:
            views.append(spec)
            continue
        lo, hi, size = spec.lifetime[0], spec.lifetime[1], spec.allocated_memory
        busy = sorted((o, o + z) for a, b, o, z in placed[mem_id] if not (hi < a or lo > b))
        off = 0
        for start, end in busy:
            if off + size <= start:
                break
            off = max(off, end)
        placed[mem_id].append((lo, hi, off, size))
        obj = arena.setdefault(mem_id, SharedObject(0, -1, 0, lo, hi))
        obj.size = max(obj.size, off + size)
        obj.first_used_index = min(obj.first_used_index, lo)
        obj.last_used_index = max(obj.last_used_index, hi)
        obj.allocations.append(AllocationSpec(off, spec))
        spec2obj[spec] = obj
    _resolve_storage_base_specs(views, spec2obj, result)
    shared = {m: [o] for m, o in arena.items()}
    result.bufsizes = _compute_total_sizes(
        shared, graph_module, extra_padding, result, len(spec2obj)
    )
    return result


def planning_pass() -> Any:
    """The memory-planning pass of every lowering: graph inputs unplanned (they are the
    runner's own buffers), the smaller of ExecuTorch's greedy and first_fit."""
    from executorch.exir.memory_planning import MemoryPlanningAlgorithmSuite, greedy
    from executorch.exir.passes import MemoryPlanningPass

    suite = MemoryPlanningAlgorithmSuite([greedy, first_fit])
    return MemoryPlanningPass(memory_planning_algo=suite, alloc_graph_input=False)


__all__ = ["first_fit", "order_for_memory", "planning_pass"]
