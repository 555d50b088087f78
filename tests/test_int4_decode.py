"""4-bit decoding through torch's int4 CPU kernel (mesp/ops/int4_mm.py) against the dequantizing
path: per weight, per decode step on every family, and for the tokens `generate` picks.

"Within bf16 rounding" is measured, not assumed: the reference is the fp32 dequantizing path,
and the int4 path may deviate from it by at most 2x what the same model computed wholly in bf16
deviates (the kernel rounds activations and the zero point to bf16, nothing else).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mesp.cli import main
from mesp.inference.generate import generate
from mesp.models.linear import FrozenWeight, int4_decoding
from mesp.models.transformer import CausalLM, KVCache
from mesp.ops import int4_mm
from mesp.quant import QuantSpec, dequantize, quantize
from tests.engine_cases import model_with_adapter
from tests.tiny_dir import make_model_dir

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


@pytest.mark.parametrize("n,k,group", [(64, 128, 64), (211, 96, 32), (48, 256, 128), (5, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantize_per_weight(n: int, k: int, group: int, dtype) -> None:  # type: ignore[no-untyped-def]
    """Any output size (padded to 16 inside), every group size: x Wᵀ within bf16 rounding of
    bf16(x) times the dequantized weight, in fp64."""
    g = torch.Generator().manual_seed(n + k)
    spec = QuantSpec(4, group)
    wq, s, b = quantize((torch.randn(n, k, generator=g) * 0.05).to(dtype), spec)
    x = torch.randn(3, 2, k, generator=g).to(dtype)
    y = int4_mm.int4_linear(x, int4_mm.pack(wq, s, b, spec))
    assert y.shape == (3, 2, n) and y.dtype == dtype
    w = dequantize(wq, s, b, spec, torch.float64)
    ref = x.bfloat16().double() @ w.T
    bound = (x.bfloat16().double().abs() @ w.abs().T) * 2**-7  # a few bf16 ulps of the sum
    assert bool(((y.double() - ref).abs() <= bound + 1e-6).all())


def test_zero_point_is_bf16_rounding_at_most() -> None:
    """z = b + 8·s in bf16: where the sum rounds (it does, for some groups), by half an ulp."""
    spec = QuantSpec(4, 64)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * torch.rand(256, 1, generator=g) * 0.1
    w += torch.randn(256, 1, generator=g) * 0.05
    _, s, b = quantize(w.bfloat16(), spec)  # rows off-centre: centred groups are all exact
    z = b.double() + 8 * s.double()
    zb = (b.float() + 8 * s.float()).bfloat16().double()
    assert bool(((zb - z).abs() <= z.abs() * 2**-8).all())  # half an ulp: 8 significant bits
    assert bool((zb != z).any())  # so the module docstring's "not always exact" is the truth


def _in_bf16(m: CausalLM) -> CausalLM:
    """The same model (same 4-bit values) with every float tensor rounded to bf16."""
    m16 = copy.deepcopy(m).to(torch.bfloat16)
    m16.dtype = torch.bfloat16
    return m16


def _decode_logits(m: CausalLM, ids: torch.Tensor, int4: bool) -> torch.Tensor:
    """Prefill 5 tokens, then decode the rest one at a time: every step's last logits, fp64."""
    with torch.no_grad(), int4_decoding(m, int4):
        cache = KVCache(k=[None] * len(m.layers), v=[None] * len(m.layers))
        out = [m(ids[:, :5], cache=cache, start=0)[0, -1]]
        for t in range(5, ids.shape[1]):
            out.append(m(ids[:, t : t + 1], cache=cache, start=t)[0, -1])
    return torch.stack(out).double()


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_on_every_family_is_within_bf16_rounding(family: str) -> None:
    spec = QuantSpec(4, 32)
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(1))
    m32 = model_with_adapter(family, spec, dtype=torch.float32)
    m16 = _in_bf16(m32)
    ref = _decode_logits(m32, ids, int4=False)
    bf16_err = (_decode_logits(m16, ids, int4=False) - ref).abs().max()
    for m in (m32, m16):
        err = (_decode_logits(m, ids, int4=True) - ref).abs().max()
        assert err <= 2 * bf16_err, (m.dtype, float(err), float(bf16_err))
    assert bf16_err <= 0.05 * ref.abs().max()  # the yardstick itself is small


@pytest.mark.parametrize("family", FAMILIES)
def test_generated_tokens_are_the_dequantize_paths_up_to_rounding(family: str) -> None:
    """Greedy tokens through the kernel: each is the dequantizing path's argmax on the same
    prefix, or ties with it within the bf16 yardstick of the test above."""
    m = model_with_adapter(family, QuantSpec(4, 32))
    m16 = _in_bf16(m)
    prompt = [3, 4, 5, 6, 7]
    out = generate(m, prompt, 20, int4=True)
    ids = torch.tensor([prompt + out])
    ref = _decode_logits(m, ids, int4=False)[:-1]  # the logits each token was picked from
    tol = 2 * (_decode_logits(m16, ids, int4=False)[:-1] - ref).abs().max()
    picked = ref.gather(1, torch.tensor(out)[:, None])[:, 0]
    assert bool((picked >= ref.max(1).values - tol).all())
    same = sum(a == b for a, b in zip(out, generate(m, prompt, 20, int4=False), strict=True))
    assert same >= 1  # and the runs do start out alike


def test_kernel_serves_only_short_rows_and_leaves_with_the_context(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[int] = []
    real = int4_mm.int4_linear
    monkeypatch.setattr(
        int4_mm, "int4_linear", lambda x, p: calls.append(x.shape[-2]) or real(x, p)
    )
    m = model_with_adapter("llama", QuantSpec(4, 32))
    weights = [w for w in m.modules() if isinstance(w, FrozenWeight) and w.quant]
    before = sum(w.nbytes() for w in weights)
    with torch.no_grad(), int4_decoding(m) as extra:
        assert extra > 0 and sum(w.nbytes() for w in weights) == before + extra  # counted
        m(torch.zeros(1, int4_mm.DECODE_ROWS + 1, dtype=torch.long))  # prefill: dequantize
        assert calls == []
        m(torch.zeros(1, 1, dtype=torch.long))
        assert calls and set(calls) == {1}
    assert all(w.int4 is None for w in weights) and sum(w.nbytes() for w in weights) == before
    x = torch.zeros(1, 1, 96, requires_grad=True)
    with int4_decoding(m):
        m.model.layers[0].self_attn.q_proj(x).sum().backward()  # training keeps dequantize
    assert set(calls) == {1} and len(calls) > 0


def test_a_stale_copy_is_never_used() -> None:
    """A weight changed in place after packing (load_state_dict copies into the buffers) falls
    back to dequantize instead of decoding with the old values."""
    spec = QuantSpec(4, 64)
    fw = FrozenWeight(64, 128, torch.float32)
    fw.set_dense(torch.randn(64, 128), spec)
    x = torch.randn(1, 128)
    assert fw.pack_for_decoding() and fw.decode_pack(x) is not None
    wq, s, b = quantize(torch.randn(64, 128), spec)
    fw.load_state_dict({"weight": wq, "scales": s, "biases": b})
    assert fw.decode_pack(x) is None
    assert fw.pack_for_decoding() and fw.decode_pack(x) is not None  # repacked from the new


def test_dense_and_8bit_weights_are_left_alone() -> None:
    fw = FrozenWeight(32, 64, torch.float32)
    fw.set_dense(torch.randn(32, 64), QuantSpec(8, 64))
    assert not fw.pack_for_decoding() and fw.int4 is None
    fw.set_dense(torch.randn(32, 64))
    assert not fw.pack_for_decoding()


def test_cli_decode_kernels_agree(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    d = make_model_dir(tmp_path / "t", "qwen2", hidden_size=96, head_dim=32, intermediate_size=160)
    out = {}
    for kernel in ("int4", "dequantize"):
        args = ["generate", "--model", str(d), "--quantize", "4", "--group-size", "32"]
        args += ["--prompt", "ab c"]
        assert main([*args, "--max-tokens", "8", "--decode-kernel", kernel]) == 0
        out[kernel] = capsys.readouterr().out
    assert out["int4"] and out["int4"] == out["dequantize"]


def test_cli_int4_kernel_refuses_a_model_without_4bit_weights(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    d = make_model_dir(tmp_path / "t", "qwen2", hidden_size=96, head_dim=32, intermediate_size=160)
    args = ["generate", "--model", str(d), "--prompt", "ab c", "--max-tokens", "2"]
    capsys.readouterr()  # the model writer's progress bars
    for quant in ("none", "8"):
        assert (
            main([*args, "--quantize", quant, "--group-size", "32", "--decode-kernel", "int4"]) != 0
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--decode-kernel int4 needs 4-bit weights" in err[0]
    assert main([*args, "--quantize", "none", "--decode-kernel", "auto"]) == 0  # auto serves it


def test_bench_decode_rows_and_report(tmp_path: Path) -> None:
    """`mesp bench decode` end to end on a tiny 4-bit model: rows written, table rendered (the
    numbers are whatever this machine gives; no threshold is tested)."""
    from mesp.bench import decode

    d = make_model_dir(tmp_path / "t", "llama", hidden_size=192, head_dim=64, intermediate_size=256)
    out = tmp_path / "bench"
    argv = ["bench", "decode", "--models", str(d), "--decode-tokens", "4", "--steps", "1"]
    argv += ["--warmup", "0", "--out", str(out), "--markdown", str(out / "B.md")]
    assert main(argv) == 0
    rows = sorted((out / "rows" / "decode").glob("*.json"))
    assert len(rows) == len(decode.ROWS) + 1
    text = (out / "B.md").read_text()
    assert "## 4-bit decoding: the int4 kernel" in text and "| 1 |" in text
    assert "first " in text and "Target `mesp generate` int4" in text
