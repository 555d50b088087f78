"""Phi-3 / Phi-4-mini: what is particular to it beyond the shared oracles (which run on it
through tests/hf_tiny.py's FAMILIES): LoRA gradients of bp, mebp and mesp against HF + PEFT
autograd on the fused projections, with LongRoPE's long and short factor sets each used, the
partial rotary, the window, and its config keys read as transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mesp.cli import main
from mesp.config import FULL, SLIDING, ModelConfig
from mesp.engines import make_engine
from mesp.errors import MespError
from mesp.models.transformer import MLP
from mesp.quant import QuantSpec
from tests.engine_cases import (
    assert_grads_match,
    check_engine_against_hf_peft,
    grads_of,
    model_with_adapter,
    padded_batch,
    peft_grads,
    with_saved_adapter,
)
from tests.hf_tiny import BASE, hf_model, mesp_from_hf


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp"])
def test_lora_grads_equal_hf_peft_autograd(engine: str, tmp_path: Path) -> None:
    """The issue's bar (cos >= 0.999999, rel <= 1e-4) against transformers' Phi-3 with PEFT on
    qkv_proj / o_proj / gate_up_proj / down_proj: seq 23 > the window (5) and > the original
    context (16), so the long factors are the ones used; 3/4 of each head rotates."""
    check_engine_against_hf_peft("phi3", engine, tmp_path)


def test_short_factors_mesp_grads_equal_hf_peft(tmp_path: Path) -> None:
    """The same bar with an original context (64) longer than the batch: the short factors."""
    hf = hf_model("phi3", original_max_position_embeddings=64)
    assert not bool((hf.model.rotary_emb.inv_freq != hf.model.rotary_emb.original_inv_freq).any())
    ours = with_saved_adapter(hf, tmp_path / "ad")
    assert sorted({n.rsplit(".", 1)[-1] for n in ours.lora_modules()}) == sorted(
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    )
    batch = padded_batch()
    ref = peft_grads(hf, tmp_path / "ad", batch)
    _, got = grads_of(make_engine("mesp"), ours, batch)
    assert_grads_match(ref, got)


def test_long_and_short_factors_switch_with_the_length() -> None:
    """Logits within 1e-6 of transformers at 13 tokens (short factors) and 23 (long); changing
    the long factors moves the 23-token logits and leaves the 13-token ones alone."""
    ids = torch.randint(0, 211, (2, 23), generator=torch.Generator().manual_seed(7))
    hf = hf_model("phi3")
    rope = dict(hf.config.rope_parameters)
    rope["long_factor"] = [f * 1.7 for f in rope["long_factor"]]
    hf_other = hf_model("phi3", rope_parameters=rope)
    with torch.no_grad():
        for s in (13, 23):
            a, b = mesp_from_hf(hf)(ids[:, :s]), mesp_from_hf(hf_other)(ids[:, :s])
            assert _rel(a, hf(ids[:, :s]).logits) <= 1e-6
            assert _rel(b, hf_other(ids[:, :s]).logits) <= 1e-6
            assert torch.equal(a, b) == (s == 13)


def test_mesp_store_h_and_tiled_mlp_equal_bp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused linears through mesp's other paths: stored h, and the MLP tiled (4 tokens a
    tile, the fused gate|up recomputed per tile): still bp's gradients."""
    model, batch = model_with_adapter("phi3"), padded_batch()
    _, g_bp = grads_of(make_engine("bp"), model, batch)
    _, g_h = grads_of(make_engine("mesp", h_strategy="store"), model, batch)
    assert_grads_match(g_bp, g_h)
    monkeypatch.setattr(MLP, "tile", 4)
    monkeypatch.setattr(MLP, "tiled", lambda self, x: not torch.is_grad_enabled())
    _, g_t = grads_of(make_engine("mesp"), model, batch)
    assert_grads_match(g_bp, g_t)


def test_partial_rotary_keeps_the_rest_unrotated() -> None:
    """With the whole head rotating instead of 3/4 the logits move (the factor is used), and
    still match transformers."""
    ids = torch.randint(0, 211, (1, 11), generator=torch.Generator().manual_seed(3))
    plain = {"rope_type": "default", "rope_theta": 7000.0, "partial_rotary_factor": 1.0}
    with torch.no_grad():
        hf_p, hf_f = hf_model("phi3"), hf_model("phi3", rope_parameters=plain)
        ours_f = mesp_from_hf(hf_f)
        assert ours_f.config.rope[FULL].partial_rotary_factor == 1.0
        assert _rel(ours_f(ids), hf_f(ids).logits) <= 1e-6
        assert not torch.allclose(mesp_from_hf(hf_p)(ids), ours_f(ids), atol=1e-3)


def _phi4_like(**over: object) -> dict:  # type: ignore[type-arg]
    n = len(range(0, int(24 * 0.75), 2))
    rope = {"type": "longrope", "short_factor": [1.0] * n, "long_factor": [2.0] * n}
    return {
        **BASE,
        "model_type": "phi3",
        "partial_rotary_factor": 0.75,
        "rope_scaling": rope,
        "original_max_position_embeddings": 64,
        "sliding_window": 50,
        "pad_token_id": None,
        "eos_token_id": 2,
        **over,
    }


def test_config_keys_read_as_transformers_reads_them() -> None:
    """Phi-4-mini's keys: partial_rotary_factor at the top level, rope_scaling of type longrope
    (or su / yarn, which Phi3Config renames), the top-level original context winning over the
    nested one, the attention factor from max_position / original; a window on every layer;
    each as transformers' own config and rotary embedding resolve it."""
    import transformers as tf

    d = _phi4_like()
    for kind in ("longrope", "su", "yarn"):
        cfg = ModelConfig.from_hf({**d, "rope_scaling": {**d["rope_scaling"], "type": kind}})
        r = cfg.rope[FULL]
        assert r.kind == "longrope" and r.partial_rotary_factor == 0.75
    assert r.original_max_position_embeddings == 64
    nested = {**d["rope_scaling"], "original_max_position_embeddings": 8}
    assert ModelConfig.from_hf({**d, "rope_scaling": nested}).rope[FULL] == r
    hf = tf.Phi3ForCausalLM(tf.Phi3Config(**{k: v for k, v in d.items() if k != "model_type"}))
    assert r.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-15)
    assert cfg.layer_types == [SLIDING, SLIDING] and cfg.sliding_window == 50
    assert cfg.rope[SLIDING] == r
    assert ModelConfig.from_hf({**d, "sliding_window": None}).layer_types == [FULL, FULL]
    explicit = {**d["rope_scaling"], "attention_factor": 1.25}
    assert ModelConfig.from_hf({**d, "rope_scaling": explicit}).rope[FULL].attention_factor == 1.25


@pytest.mark.parametrize(
    "over,msg",
    [
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "short_factor and"),
        ({"rope_scaling": {**_phi4_like()["rope_scaling"], "long_factor": [1.0]}}, "need 9"),
        ({"rope_scaling": {"type": "longrope"}}, "short_factor and long_factor"),
        ({"rope_scaling": {"type": "llama3", "factor": 2.0}}, "not supported for phi3"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_keys_fail_in_one_line(over: dict, msg: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(MespError, match=msg):
        ModelConfig.from_hf(_phi4_like(**over))


def test_merge_writes_phi3_hf_and_mlx_dirs(tmp_path: Path) -> None:
    """merge: an HF directory of Phi3ForCausalLM (fused names) that transformers loads with
    base + adapter's logits; with --quantize 4 an MLX directory that loads back bit for bit."""
    import transformers

    from mesp.convert.merge import merge_into_base
    from mesp.loading import load_model
    from mesp.lora import load_adapter
    from tests.test_merge import IDS, WIDE, _adapter
    from tests.tiny_dir import make_model_dir

    base = make_model_dir(tmp_path / "base", "phi3", **WIDE)
    _adapter(base, tmp_path / "ad")
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out"]
    assert main([*argv, str(tmp_path / "m")]) == 0
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert conf["architectures"] == ["Phi3ForCausalLM"] and conf["model_type"] == "phi3"
    ref = load_model(base).model
    load_adapter(ref, tmp_path / "ad")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    assert "model.layers.0.self_attn.qkv_proj.weight" in hf.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, ref(IDS), atol=1e-4, rtol=0)
    assert main([*argv, str(tmp_path / "m4"), "--quantize", "4", "--group-size", "64"]) == 0
    merge_into_base(ref, QuantSpec(4, 64))
    loaded = load_model(tmp_path / "m4")
    assert loaded.fmt == "mlx" and loaded.model.layers[0].mlp.gate_up_proj.quant == QuantSpec(4, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(IDS), ref(IDS))


@pytest.mark.parametrize("bits", ["4", "8"])
def test_cli_trains_quantized(bits: str, tmp_path: Path) -> None:
    """`mesp train --quantize 4|8` on a Phi-3 HF directory: finite losses, a PEFT adapter."""
    from tests.test_merge import WIDE
    from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

    base = make_model_dir(tmp_path / "m", "phi3", **WIDE)
    data, out = make_jsonl(tmp_path / "d.jsonl", n=8), tmp_path / "ad"
    flags = dict(steps=2, batch_size=2, seq_len=24, quantize=bits, eval_every=0, rank=2)
    assert main(train_argv(base, data, out, **flags)) == 0
    conf = json.loads((out / "adapter_config.json").read_text())
    assert sorted(conf["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]


def test_info_names_phi3s_pieces(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`mesp info` names the fused linears, the partial rotary and LongRoPE (the on-device
    programs, with the long factors: tests/test_ondevice_et.py)."""
    from tests.tiny_dir import make_model_dir

    base = make_model_dir(tmp_path / "m", "phi3")
    assert main(["info", "--model", str(base)]) == 0
    out = capsys.readouterr().out
    assert "fused        qkv_proj (q | k | v), gate_up_proj (gate | up)" in out
    assert "rotary       18 of 24 dims per head" in out
    assert "rope         longrope: long factors past 16 tokens, cos/sin × 1.414" in out
    assert "parameters at rank 8 on qkv_proj,o_proj,gate_up_proj,down_proj" in out


def test_cached_decoding_follows_transformers_past_the_switch() -> None:
    """Decoding one token at a time with the KV cache, past the window (5) and past the original
    context (16): each step's logits are transformers' own cached decoding's. Its factor set
    follows the whole length, so from token 17 on the new keys rotate with the long factors
    while the cached ones keep the short: not the full forward's logits, as in transformers."""
    from mesp.models.transformer import KVCache

    hf = hf_model("phi3")
    m = mesp_from_hf(hf)
    ids = torch.randint(0, 211, (1, 22), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids[:, :3], use_cache=True)
        ref, hf_cache = [out.logits[0, -1]], out.cache
        for t in range(3, 22):
            out = hf(ids[:, t : t + 1], cache=hf_cache, use_cache=True)
            ref.append(out.logits[0, -1])
            hf_cache = out.cache
        cache = KVCache(k=[None] * 2, v=[None] * 2)
        got = [m(ids[:, :3], cache=cache, start=0)[0, -1]]
        got += [m(ids[:, t : t + 1], cache=cache, start=t)[0, -1] for t in range(3, 22)]
        full = m(ids)[0, 2:]
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-5, rtol=0)
    assert not torch.allclose(torch.stack(got)[-1], full[-1], atol=1e-3)
