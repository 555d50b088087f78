"""Mistral, SmolLM3 and Granite 3: each family's new piece of math against transformers, its
config keys read as transformers reads them, and `mesp train` on an HF directory of each.

The shared oracles (parity, PEFT round trip, bp/mebp/mesp gradients, mesp.patch, merge) run on
these families through tests/hf_tiny.py's FAMILIES; this file holds what is particular to them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mesp.cli import main
from mesp.config import FULL, SLIDING, ModelConfig
from mesp.loading import load_model
from mesp.lora import load_adapter
from mesp.models.transformer import KVCache
from tests.hf_tiny import BASE, hf_model, mesp_from_hf
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

NEW = ("mistral", "smollm3", "granite", "olmo2", "gemma2", "phi3")
IDS = torch.randint(0, 211, (2, 19), generator=torch.Generator().manual_seed(1))  # 19 > window 5


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("family", NEW)
def test_logits_within_1e6_of_transformers(family: str) -> None:
    """The issue's bar: rel <= 1e-6 in fp32 at a sequence longer than every window. (Granite's
    logits ÷ s is applied to the normed hidden state, before the linear head: (h/s)Wᵀ and
    (hWᵀ)/s round differently, ~5e-7 here; the other two are bit for bit.)"""
    hf = hf_model(family)
    with torch.no_grad():
        assert _rel(mesp_from_hf(hf)(IDS), hf(IDS).logits) <= 1e-6


@pytest.mark.parametrize(
    "family,plain",
    [
        ("mistral", {"sliding_window": None}),
        ("smollm3", {"no_rope_layers": [1, 1], "use_sliding_window": False}),
        (
            "granite",
            {
                "embedding_multiplier": 1.0,
                "residual_multiplier": 1.0,
                "attention_multiplier": 24**-0.5,
                "logits_scaling": 1.0,
            },
        ),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("phi3", {"sliding_window": None}),
        ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 7000.0}}),
    ],
)
def test_the_new_piece_changes_the_output(family: str, plain: dict) -> None:  # type: ignore[type-arg]
    """Without its new piece the family is Llama: the logits must then differ (the piece is
    used), and still match transformers (the piece can be switched off as transformers does)."""
    with torch.no_grad():
        ours = mesp_from_hf(hf_model(family))(IDS)
        hf_plain = hf_model(family, **plain)
        ours_plain = mesp_from_hf(hf_plain)(IDS)
        assert not torch.allclose(ours, ours_plain, atol=1e-3)
        torch.testing.assert_close(ours_plain, hf_plain(IDS).logits, atol=1e-5, rtol=0)


def test_mistral_window_keys() -> None:
    """sliding_window null: no window; absent: transformers' default 4096; set: every layer."""
    d = {**BASE, "model_type": "mistral"}
    assert ModelConfig.from_hf({**d, "sliding_window": None}).layer_types == [FULL, FULL]
    absent = ModelConfig.from_hf(d)
    assert absent.sliding_window == 4096 and absent.layer_types == [SLIDING, SLIDING]
    cfg = ModelConfig.from_hf({**d, "sliding_window": 7, "rope_theta": 1e6})
    assert cfg.rope[SLIDING] == cfg.rope[FULL] and cfg.rope[FULL].theta == 1e6


def test_smollm3_rope_keys() -> None:
    """no_rope_layers: 1 rotates, 0 does not; absent, every 4th layer is NoPE; with
    use_sliding_window the NoPE layers slide; rope_theta defaults to 2e6."""
    d = {**BASE, "model_type": "smollm3", "num_hidden_layers": 8}
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_layers == [True, True, True, False] * 2 and cfg.rope[FULL].theta == 2e6
    assert cfg.layer_types == [FULL] * 8 and cfg.sliding_window is None
    cfg = ModelConfig.from_hf({**d, "use_sliding_window": True, "sliding_window": 9})
    assert cfg.layer_types == [FULL, FULL, FULL, SLIDING] * 2 and cfg.sliding_window == 9


@pytest.mark.parametrize("family", NEW)
def test_config_round_trips_through_transformers(family: str) -> None:
    """to_hf (what merge writes) read back by mesp and by transformers' own config class."""
    import transformers as tf

    cfg = ModelConfig.from_hf(hf_model(family).config.to_dict())
    d = cfg.to_hf()
    assert ModelConfig.from_hf(d) == cfg
    hf_cfg = tf.AutoConfig.for_model(**d)
    assert ModelConfig.from_hf(hf_cfg.to_dict()) == cfg


@pytest.mark.parametrize("family", ["mistral", "smollm3", "gemma2"])
def test_decoding_with_the_cache_equals_the_full_forward(family: str) -> None:
    """Prefill 3 tokens, then one token at a time past the window (5): each step's logits are
    the full forward's (the cache keeps only the window on sliding layers)."""
    m = mesp_from_hf(hf_model(family))
    ids = IDS[:1]
    with torch.no_grad():
        full = m(ids)[0]
        cache = KVCache(k=[None] * len(m.layers), v=[None] * len(m.layers))
        steps = [m(ids[:, :3], cache=cache, start=0)[0, -1]]
        steps += [m(ids[:, t : t + 1], cache=cache, start=t)[0, -1] for t in range(3, 19)]
    torch.testing.assert_close(torch.stack(steps), full[2:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", NEW)
def test_cli_trains_an_hf_directory(family: str, tmp_path: Path) -> None:
    """`mesp train --model DIR` on a transformers directory of the family (random weights, the
    real config's keys at tiny sizes): finite losses, and an adapter that loads back."""
    model_dir = make_model_dir(tmp_path / "m", family)
    data, out = make_jsonl(tmp_path / "d.jsonl", n=12), tmp_path / "ad"
    flags = dict(steps=3, batch_size=2, seq_len=32, quantize="none", eval_every=0, rank=2)
    assert main(train_argv(model_dir, data, out, **flags)) == 0
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    model = load_model(model_dir).model
    assert load_adapter(model, out).rank == 2


@pytest.mark.parametrize("family", NEW)
def test_mezo_loss_is_bps(family: str) -> None:
    """MeZO's forward-only loss (chunked CE on model.hidden) is the autograd forward's."""
    from mesp.engines import make_engine
    from tests.engine_cases import grads_of, model_with_adapter, padded_batch

    model, batch = model_with_adapter(family), padded_batch()
    loss_bp, _ = grads_of(make_engine("bp"), model, batch)
    assert make_engine("mezo").loss_sum(model, batch) == pytest.approx(loss_bp, rel=1e-6)


@pytest.mark.parametrize("family", ["mistral", "smollm3"])
def test_mesp_through_the_chunked_attention_matches_bp(family: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where the CPU flash kernel is not used (CUDA, other torches), mesp's forward and backward
    take the exact query-chunked attention: with chunks of 4 queries and the window (5) of every
    (Mistral) or of the NoPE (SmolLM3) layer, still bp's gradients at seq 23 > window."""
    from mesp.engines import make_engine
    from mesp.ops import attention, attention_chunked
    from tests.engine_cases import assert_grads_match, grads_of, model_with_adapter, padded_batch

    model, batch = model_with_adapter(family), padded_batch()
    _, g_bp = grads_of(make_engine("bp"), model, batch)
    fwd, bwd = attention_chunked.chunked_fwd, attention_chunked.chunked_bwd
    calls: list[int] = []

    def chunked_fwd(*a):  # type: ignore[no-untyped-def]
        calls.append(1)
        return fwd(*a[:5], 4)

    monkeypatch.setattr(attention, "_use_flash", lambda q, impl: False)
    monkeypatch.setattr(attention_chunked, "chunked_fwd", chunked_fwd)
    monkeypatch.setattr(attention_chunked, "chunked_bwd", lambda *a: bwd(*a[:8], 4))
    _, g_ms = grads_of(make_engine("mesp"), model, batch)
    assert len(calls) == 2  # one recompute per block
    assert_grads_match(g_bp, g_ms)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_two_ranks_equal_one_process(family: str, tmp_path: Path) -> None:
    """Data parallel (mesp engine, 2 ranks) trains each family as one process does."""
    from safetensors.torch import load_file

    from tests.test_distributed import _train

    model = make_model_dir(tmp_path / "m", family)
    data = make_jsonl(tmp_path / "d.jsonl", 30)
    one = _train(model, data, tmp_path / "one", "--engine", "mesp")
    assert one.returncode == 0, one.stderr[-2000:]
    two = _train(model, data, tmp_path / "two", "--engine", "mesp", "--nproc", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    a = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-6 for k in a)


def test_info_names_each_familys_piece(capsys: pytest.CaptureFixture) -> None:
    """`mesp info` on the zoo shapes: the window, the NoPE layers and Granite's scalars."""
    for name in ("mistral-7b-v0.3", "smollm3-3b", "granite-3.1-2b"):
        assert main(["info", "--model", f"random:{name}"]) == 0
    out = capsys.readouterr().out
    assert "parameters   7,248,023,552" in out and "no RoPE      on 9 of 36 layers" in out
    assert "multipliers  embedding 12, residual 0.22, attention 0.015625, logits ÷ 8" in out
