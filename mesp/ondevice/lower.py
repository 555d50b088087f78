"""Lowering one named program to ExecuTorch (.pte), with the fixes that keep it exact and small.

Each is a trap of executorch 1.5.1 that gives no error (../shared/reference/FACTS.md), and each
but the last has a test in tests/test_ondevice_et.py (the last shows in the planned bytes of
the block backward that `mesp export` reports):
  - weights are program inputs, so XNNPACK must be told to take non-static f32 linears
    (`force_non_static_weights_for_f32_linear`), else every matmul runs on portable kernels;
  - with that, XNNPACK drops the added term, alpha and beta of a 2-D `addmm`: every addmm is
    decomposed into mm, mul and add before lowering;
  - XNNPACK computes `gelu(approximate="tanh")` as the erf form: GELU stays out of the delegate;
  - the memory planner copies every graph input (frozen weights included) into its arena unless
    `alloc_graph_input=False`: inputs are the runner's own buffers, never planned;
  - a reshape inside an XNNPACK partition is a copy into a new output buffer (a second
    (tokens × 4864) tensor in the MLP's backward), where outside it the emitter makes it a view
    of the same memory: view_copy stays out of the delegate.
The op order and the arena offsets are memory_plan's (order_for_memory, planning_pass).
Node provenance ("from_node") is dropped before each stage: it is only for ExecuTorch's inspector,
and every pass deep-copies each node's whole history, so it grows with the passes run (a quarter
of a tiny model's lowering time).
The lowered program's planned-memory buffer sizes are read back from the emitted plan.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mesp.errors import MespError
from mesp.ondevice.memory_plan import order_for_memory, planning_pass
from mesp.ondevice.steps import Flat

_ATEN = torch.ops.aten
_ADDMM = (_ATEN.addmm.default, _ATEN.addmm_.default)
ST_NAMES = {torch.float32: "F32", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def _addmm(inp: Tensor, m1: Tensor, m2: Tensor, *, beta: float = 1, alpha: float = 1) -> Tensor:
    """addmm as mm, mul and add (what XNNPACK's addmm would silently get wrong)."""
    prod = torch.mm(m1, m2)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return (inp if beta == 1 else inp * beta) + prod


def _drop_provenance(ep: Any) -> Any:
    """Forget each node's pass history (meta "from_node"; the passes after this start anew)."""
    for node in ep.graph.nodes:
        node.meta.pop("from_node", None)
    return ep


@dataclass(frozen=True)
class Lowered:
    pte: bytes
    planned: list[int]  # bytes per planned-memory buffer (index 0 is ExecuTorch's reserved id)
    delegated: int  # delegate calls in the program (XNNPACK subgraphs)


def _partitioner() -> Any:
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import (
        GeluConfig,
        ViewCopyConfig,
    )
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    configs = [c for c in ALL_PARTITIONER_CONFIGS if c not in (GeluConfig, ViewCopyConfig)]
    return XnnpackPartitioner(configs=configs, force_non_static_weights_for_f32_linear=True)


NEEDS_EXECUTORCH = (
    "mesp export needs the executorch package: pip install executorch==1.5.1 torchao==0.18.0 "
    "(beside torch 2.13.0; or the ondevice extra)"
)


def require_executorch() -> None:
    """Refuse before any work where the lowering could not run."""
    if importlib.util.find_spec("executorch") is None:
        raise MespError(NEEDS_EXECUTORCH)


def lower(
    prog: Flat,
    example: list[Tensor],
    dynamic: dict[int, tuple[str, int]],
    delegate: bool = True,
) -> Lowered:
    """torch.export the flat program on `example` (dynamic: input index -> (dim name, max) of its
    dim 0), decompose addmm, lower with XNNPACK (unless `delegate` is False: portable kernels
    only) and emit with unplanned inputs."""
    try:
        from executorch.exir import (
            EdgeCompileConfig,
            ExecutorchBackendConfig,
            to_edge_transform_and_lower,
        )
    except ImportError:
        raise MespError(NEEDS_EXECUTORCH) from None
    dims = {n: torch.export.Dim(n, min=1, max=mx) for n, mx in {v for v in dynamic.values()}}
    shapes = tuple({0: dims[dynamic[i][0]]} if i in dynamic else None for i in range(len(example)))
    dyn_shapes = (shapes,) if dynamic else None  # the one *tensors argument, as a tuple
    args = tuple(t.contiguous() for t in example)
    name = getattr(prog.fn, "__qualname__", "program").split(".")[0]
    try:
        ep = _drop_provenance(
            torch.export.export(prog, args, dynamic_shapes=dyn_shapes, strict=False)
        )
        # addmm alone: decomposing everything here would also split the linears that the
        # partitioner takes whole (and triple the lowering time). A program with no addmm
        # (in place or not) skips this retrace: the lowering functionalizes it anyway.
        if any(n.target in _ADDMM for n in ep.graph.nodes):
            ep = _drop_provenance(ep.run_decompositions({_ATEN.addmm.default: _addmm}))
        if ep.state_dict or ep.constants:
            raise MespError(f"{name}: the program captured tensors as constants")
        edge = to_edge_transform_and_lower(
            ep,
            partitioner=[_partitioner()] if delegate else None,
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        order_for_memory(edge.exported_program().graph_module)
        et = edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=planning_pass()))
    except MespError:
        raise
    except Exception as e:  # export and lowering raise many exception types
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise MespError(f"lowering {name} to ExecuTorch failed: {type(e).__name__}: {msg}") from e
    plan = et.executorch_program.execution_plan[0]
    return Lowered(et.buffer, list(plan.non_const_buffer_sizes), len(plan.delegates))


def io_rows(
    names: list[str], tensors: list[Tensor], dynamic: dict[int, tuple[str, int]] | None = None
) -> list[dict[str, Any]]:
    """run_config rows for a program's inputs or outputs: name, dtype, (upper-bound) shape."""
    rows = []
    for i, (n, t) in enumerate(zip(names, tensors, strict=True)):
        shape = list(t.shape)
        dyn = []
        if dynamic is not None and i in dynamic:
            shape[0], dyn = dynamic[i][1], [0]
        rows.append({"name": n, "dtype": ST_NAMES[t.dtype], "shape": shape, "dynamic_dims": dyn})
    return rows


__all__ = ["Lowered", "io_rows", "lower", "require_executorch"]
