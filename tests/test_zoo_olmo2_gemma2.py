"""The OLMo 2 and Gemma 2 zoo shapes through `mesp info` and `mesp plan` (the planner on their
ladders, the memory model's capped-attention terms at Gemma 2's real window)."""

from __future__ import annotations

import json

import pytest

from mesp.cli import main
from mesp.memory.model import predict
from mesp.memory.plan import shape_config


def test_info_on_the_zoo_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("olmo2-7b", "gemma2-2b"):
        assert main(["info", "--model", f"random:{name}"]) == 0
    out = capsys.readouterr().out
    assert "family       olmo2" in out and "parameters   7,298,617,344" in out
    assert "vocab        100352   tied embeddings: False" in out
    assert "family       gemma2" in out and "parameters   2,614,341,888" in out
    assert "sliding      window 4096 on 13 of 26 layers" in out
    assert "soft-caps    attention 50, logits 30" in out


@pytest.mark.parametrize("name,memory", [("olmo2-7b", "8GB"), ("gemma2-2b", "4GB")])
def test_plan_on_the_zoo_shapes(name: str, memory: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--memory", memory, "--model", name, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cfg = shape_config(name)
    assert plan["family"] == cfg.family and plan["family_sizes"] == [name]
    eng = plan["engines"]
    tot = {e: r["total"] for e, r in eng.items()}
    assert tot["mesp"] < tot["mebp"] < tot["bp"]
    assert eng["mesp"]["fits"] and eng["mesp"]["largest_model"] == name
    assert 256 < eng["mesp"]["longest_seq"] <= cfg.max_position_embeddings
    assert main(["plan", "--memory", memory, "--model", name]) == 0  # the table prints too
    assert f"largest {cfg.family} that fits" in capsys.readouterr().out


def test_gemma2_plan_past_the_window_counts_the_chunked_attention() -> None:
    """At 8192 positions (twice Gemma 2's 4096 window) the capped attention builds no (S, S)
    additive window mask, which the flash path would (S²·4 bytes, 256 MiB here), but holds
    (B, H, 256, keys) fp32 chunk scores (64 MiB at most each) in its backward: the capped
    block backward sits below the flash one's by less than the mask."""
    cfg = shape_config("gemma2-2b")
    uncapped = shape_config("gemma2-2b")
    uncapped.attn_logit_softcapping = None
    cap, flash = (predict(c, "mesp", 8192, 1)["phase:block backward"] for c in (cfg, uncapped))
    assert 0 < int(flash) - int(cap) < 8192 * 8192 * 4
    assert int(predict(cfg, "mesp", 8192, 1)["total"]) < int(predict(cfg, "mebp", 8192, 1)["total"])
