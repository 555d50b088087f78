"""mesp.ondevice.memory_plan: the op order and arena offsets every lowering uses.

A program whose traced order holds two large tensors at once where another order holds one:
the re-ordered program plans about one, and computes the same values on the runtime. The
first-fit planner is checked against ExecuTorch's own verifier of storage reuse (no two tensors
alive at once share a byte) on a program with many tensors of mixed sizes and lifetimes.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from mesp.ondevice.lower import lower
from mesp.ondevice.memory_plan import _Bytes, _greedy, _peak, first_fit
from mesp.ondevice.steps import Flat, Named

pytest.importorskip("executorch")

BIG = (64, 1024)  # 256 KiB of fp32


def _two_branches(d: Named) -> Named:
    x = d["a0"]
    a, b = x.exp(), x.sin()  # traced first: both are alive until their sums
    return {"y": torch.stack([a.sum(), b.sum()])}


def _execute(fn, args: list[Tensor]) -> tuple[Tensor, list[int]]:  # type: ignore[no-untyped-def]
    from executorch.runtime import Runtime

    low = lower(Flat(fn, ["a0"], ["y"]), args, {}, delegate=False)
    out = Runtime.get().load_program(low.pte).load_method("forward").execute(args)[0]
    return out.clone(), low.planned


def test_reordered_program_holds_one_large_tensor_and_computes_the_same() -> None:
    x = torch.randn(*BIG, generator=torch.Generator().manual_seed(0))
    one = x.numel() * 4
    got, planned = _execute(_two_branches, [x])
    assert sum(planned) < 1.5 * one, planned  # traced order: two at once
    ref = _two_branches({"a0": x})["y"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3)


def test_greedy_order_lowers_the_estimated_peak() -> None:
    ep = torch.export.export(Flat(_two_branches, ["a0"], ["y"]), (torch.randn(*BIG),))
    body = [n for n in ep.graph_module.graph.nodes if n.op == "call_function"]
    m = _Bytes(body)
    order = _greedy(body, m)
    assert sorted(map(str, order)) == sorted(map(str, body))  # every node, once
    pos = {n: i for i, n in enumerate(order)}
    assert all(pos[a] < pos[n] for n in order for a in n.all_input_nodes if a in pos)
    one = torch.Size(BIG).numel() * 4
    assert _peak(body, m) >= 2 * one > _peak(order, m) >= one


def _many(d: Named) -> Named:
    x, outs = d["a0"], []
    for i in range(6):  # tensors of several sizes, some kept to the end, some short-lived
        t = (x[: 8 * (i + 1)] * (0.1 * (i + 1))).exp()
        u = torch.cat([t, t.sin()]).cos()
        outs.append(u.sum(0) + x[i])
    return {"y": torch.stack(outs)}


def test_first_fit_never_overlaps_two_live_tensors() -> None:
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge
    from executorch.exir.memory_planning import MemoryPlanningAlgorithmSuite, Verifier
    from executorch.exir.passes import MemoryPlanningPass

    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    ep = torch.export.export(Flat(_many, ["a0"], ["y"]), (x,))
    edge = to_edge(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    only = MemoryPlanningAlgorithmSuite([first_fit])
    et = edge.to_executorch(
        ExecutorchBackendConfig(
            memory_planning_pass=MemoryPlanningPass(
                memory_planning_algo=only, alloc_graph_input=False
            )
        )
    )
    prog = et.exported_program()
    verifier = Verifier(prog.graph_module, False, True, True, prog.graph_signature)
    assert verifier.verify_storage_reuse() > 0  # tensors did share memory, none while alive

    from executorch.runtime import Runtime

    got = Runtime.get().load_program(et.buffer).load_method("forward").execute([x])[0]
    torch.testing.assert_close(got, _many({"a0": x})["y"], rtol=1e-5, atol=1e-5)
