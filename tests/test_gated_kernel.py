"""mesp::gated_act / gated_act_dgate / gated_act_dup: the MLP's gated activation and its backward
as ExecuTorch kernels (mesp/ondevice/gated_act.cpp, defined for the export in
mesp/ops/gated_kernel.py), against the written-out formulas they replace, on the runtime.

- Values: each kernel equals the engine's eager op (mesp.ops.mlp: ATen's silu / gelu and their
  fused backwards) within a few ulps (libm's exp / tanh against SLEEF's; measured on this
  machine: 60-96% of the values to the bit, where the written-out formulas give 52-99%), for
  silu and gelu_tanh, over a size that is not a multiple of the kernels' chunk.
- Memory: a program of the MLP's backward plans only its outputs with the kernels, where the
  written-out formulas plan their temporaries too (the point of the ops).
The block programs use them (BlockSpec.act_kernel); tests/test_ondevice_et.py checks every family's
exported step against the engine with them in place.
"""

from __future__ import annotations

import pytest
import torch

from mesp.ondevice.kernels import load_kernels
from mesp.ondevice.lower import lower
from mesp.ondevice.steps import Flat, Named
from mesp.ops import gated_kernel
from mesp.ops.mlp import ACTIVATIONS, _written_out, gated_act, gated_act_backward

pytest.importorskip("executorch")

SHAPE = (2, 37, 300)  # 22,200 values: five chunks of 4,096 and a remainder


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) * 3 for _ in range(3)]  # dm, gate, up


def _execute(fn, args: list[torch.Tensor], outs: list[str], delegate: bool = True):  # type: ignore[no-untyped-def]
    from executorch.runtime import Runtime

    load_kernels()
    low = lower(Flat(fn, [f"a{i}" for i in range(len(args))], outs), args, {}, delegate)
    method = Runtime.get().load_program(low.pte).load_method("forward")
    return [t.clone() for t in method.execute(args)], low


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_kernels_equal_the_engines_ops(act: str) -> None:
    def fn(d: Named) -> Named:
        d_gate, d_up = gated_kernel.gated_backward(d["a0"], d["a1"], d["a2"], act)
        return {"m": gated_kernel.gated(d["a1"], d["a2"], act), "dg": d_gate, "du": d_up}

    dm, gate, up = args = _inputs(1)
    got, _ = _execute(fn, args, ["m", "dg", "du"])
    d_gate, d_up = gated_act_backward(dm, gate, up, act)  # eager: the engine's own ops
    refs = (gated_act(gate, up, act), d_gate, d_up)
    for name, y, ref in zip(("m", "dg", "du"), got, refs, strict=True):
        scale = float(ref.abs().max())
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=2e-6 * scale, msg=name)


def test_the_backward_plans_only_its_outputs() -> None:
    """Portable kernels (no delegate), so every tensor a program holds is in its plan: with the
    kernels the MLP's backward plans its two outputs; written out, at least two more (the
    memory-frugal op order of mesp.ondevice.memory_plan included)."""
    one = torch.finfo(torch.float32).bits // 8 * torch.Size(SHAPE).numel()

    def fused(d: Named) -> Named:
        d_gate, d_up = gated_kernel.gated_backward(d["a0"], d["a1"], d["a2"], "silu")
        return {"dg": d_gate, "du": d_up}

    def written(d: Named) -> Named:
        d_gate, d_up = _written_out(d["a0"], d["a1"], d["a2"], "silu")
        return {"dg": d_gate, "du": d_up}

    args = _inputs(2)
    (kg, ku), low_k = _execute(fused, args, ["dg", "du"], delegate=False)
    (wg, wu), low_w = _execute(written, args, ["dg", "du"], delegate=False)
    assert sum(low_k.planned) <= 2 * one + 4096
    assert sum(low_w.planned) >= 4 * one
    torch.testing.assert_close(kg, wg, rtol=2e-6, atol=2e-6 * float(wg.abs().max()))
    torch.testing.assert_close(ku, wu, rtol=2e-6, atol=2e-6 * float(wu.abs().max()))
