"""Exported programs can dequantize a quantized weight in blocks (issue 28 item 3, `mesp export
--weight-block-kb`): mesp.ops.matmul.TracedBlocks gives F.linear's and dy @ W's values (the
GEMM's rounding apart) from row blocks for x Wᵀ and column blocks for dy W, the block programs
built on it equal the whole-weight programs, and an export in blocks trains like the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from mesp.ondevice.programs import WeightSpec, base, dense
from mesp.ops.matmul import TracedBlocks, weight_spans
from mesp.quant import QuantSpec, packed_bytes, quantize


def _weights(out_f: int, in_f: int, bits: int, edge: bool) -> tuple[dict, WeightSpec]:
    g = torch.Generator().manual_seed(out_f + in_f)
    spec = QuantSpec(bits, 32)
    wq, s, b = quantize(torch.randn(out_f, in_f, generator=g), spec)
    w = {"p.weight": packed_bytes(wq) if edge else wq, "p.scales": s, "p.biases": b}
    return w, WeightSpec("p", spec, core_aten=edge, block_bytes=4096)


@pytest.mark.parametrize("edge", [False, True], ids=["words", "bytes"])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("shape", [(96, 64), (40, 160)], ids=["rows", "columns"])
def test_blocks_give_the_whole_weights_products(
    shape: tuple[int, int], bits: int, edge: bool
) -> None:
    w, ws = _weights(*shape, bits, edge)
    src = base(w, ws)
    assert isinstance(src, TracedBlocks)
    for rows_cut in (True, False):  # x Wᵀ takes row blocks, dy W column blocks
        assert len(weight_spans(shape, 32, 4096, rows_cut)[1]) >= 2  # several blocks
    full = dense(w, replace(ws, block_bytes=None), torch.float32)
    every = slice(0, None)
    assert torch.equal(src.block(every, every, torch.float32), full)  # the same dequantized bits
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, 7, shape[1], generator=g), torch.randn(2, 7, shape[0], generator=g)
    # every output is one whole dot product, as the whole matrix's: the GEMM kernel's summation
    # order apart (another N may take another kernel), ulps of the sum of |terms|
    tol_y = 1e-6 * float((x.abs() @ full.abs().t()).max())
    tol_dx = 1e-6 * float((dy.abs() @ full.abs()).max())
    torch.testing.assert_close(src.linear(x), F.linear(x, full), rtol=0, atol=tol_y)
    torch.testing.assert_close(src.matmul(dy), dy @ full, rtol=0, atol=tol_dx)


def test_unquantized_or_unblocked_weights_stay_whole() -> None:
    w, ws = _weights(96, 64, 4, True)
    assert not isinstance(base(w, replace(ws, block_bytes=None)), TracedBlocks)
    dense_w = {"p.weight": torch.randn(96, 64)}
    assert not isinstance(base(dense_w, WeightSpec("p", None, block_bytes=4096)), TracedBlocks)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_block_programs_in_blocks_equal_the_whole_weight_programs(family: str) -> None:
    """One 4-bit block's forward (with its tape) and hand backward, as the edge programs run
    them: in 2 KiB weight blocks (every projection cut in several) against whole weights."""
    from mesp.ondevice.export import _blocks, _ctx
    from mesp.ondevice.export_et import edge_block_spec, edge_weights
    from mesp.ondevice.programs import block_forward, block_parts
    from mesp.ondevice.programs_backward import block_backward
    from tests.engine_cases import model_with_adapter

    model = model_with_adapter(family, quant=QuantSpec(4, 32))
    s = 19
    ctx = _ctx(model, s)
    groups, _, _ = _blocks(model, ctx)
    (bs, lt, *_), (_, i) = next(iter(groups.items()))
    w, lora = block_parts(model.layers[i])
    w = edge_weights(w)
    whole = edge_block_spec(bs, 8)
    whole = replace(
        whole, linears=tuple((n, replace(ws, block_bytes=None)) for n, ws in whole.linears)
    )
    cut = replace(
        whole, linears=tuple((n, replace(ws, block_bytes=2048)) for n, ws in whole.linears)
    )
    for _, ws in cut.linears:
        shape = (w[f"{ws.prefix}.scales"].shape[0], w[f"{ws.prefix}.scales"].shape[1] * 32)
        for rows_cut in (True, False):
            assert len(weight_spans(shape, 32, 2048, rows_cut)[1]) > 1, ws.prefix
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, s, model.config.hidden_size, generator=g)
    dy = torch.randn(2, s, model.config.hidden_size, generator=g)
    outs = []
    for spec in (whole, cut):
        tape: dict = {}
        y = block_forward(spec, w, lora, x, ctx[lt], tape)
        dx, grads = block_backward(spec, tape, dy, x, w, lora, ctx[lt])
        outs.append((y, dx, grads))
    (y0, dx0, g0), (y1, dx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) == 14
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-5 * float(g0[k].abs().max()))


@pytest.mark.slow  # lowering ~20 weight blocks per linear takes a few minutes
def test_weight_blocked_export_trains_like_the_engine(runner_bin, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """mesp export --weight-block-kb 8 on the tiny 4-bit Qwen2 (every projection cut in 3 to 8
    blocks each way): 20 SGD steps of the Python driver give the engine's losses within the
    whole-matrix export's bound, and the native runner gives the Python driver's."""
    import json
    import subprocess

    from mesp.ondevice import et_driver, runner
    from tests import export_cases as T
    from tests.et_cases import EtCase
    from tests.test_ondevice_et import LR, STEPS, TOL

    pytest.importorskip("executorch")
    case = EtCase("qwen2", "q4", tmp_path, weight_block_kb=8)
    art = case.dir
    assert case.conf["executorch"]["weight_block_bytes"] == 8192
    rows = T._rows()
    _, losses = et_driver.train(case.art, rows, runner.RunConfig(STEPS, LR["sgd"], "sgd"))
    ref = T._engine_run(case, rows, STEPS)  # type: ignore[arg-type]
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= TOL["sgd"], (losses, ref)
    data, out, log = T._write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "a", tmp_path / "l"
    argv = [str(runner_bin), str(art), "--data", str(data), "--steps", str(STEPS)]
    argv += ["--lr", repr(LR["sgd"]), "--out", str(out), "--json-log", str(log)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    native = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert max(abs(a - b) for a, b in zip(native, losses, strict=True)) <= 1e-6
