"""Issue 30 item 7: the memory model, `mesp plan` and `--max-memory` know the objective. A DPO /
ORPO step on B/2 pairs is SFT's step on the same B rows plus the (B, S) token weights and (B,)
log-prob buffers; its log-prob passes hold no tape. Checked against the exact tracker with the
tolerance of tests/test_memory_model.py, and the difference from SFT to the byte."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mesp.batch import Batch
from mesp.cli.plan import add_parser
from mesp.config import ModelConfig
from mesp.engines import make_engine
from mesp.engines.objective import Objective, PreferenceEngine
from mesp.errors import MespError
from mesp.loading import random_model
from mesp.lora import LoraConfig, apply_lora
from mesp.memory.model import predict
from mesp.memory.plan import Run, shape_config
from mesp.memory.tracker import adapter_tensors, measure_peak
from mesp.quant import QuantSpec
from mesp.training.schedule import make_optimizer
from tests.test_memory_model import small_config

Q4 = QuantSpec(4, 64)


def measure(cfg: ModelConfig, engine: str, seq: int, quant: QuantSpec | None, obj: str) -> int:
    """Peak of one trainer iteration on one pair (2 rows) after a warm-up iteration, as
    test_memory_model.measure; obj sft: the same 2 rows as an SFT batch."""
    model = random_model(cfg, quant, torch.float32)
    apply_lora(model, LoraConfig(rank=8))
    params = model.lora_parameters()
    eng = make_engine(engine)
    if obj != "sft":
        eng = PreferenceEngine(eng, Objective(obj))
    opt = make_optimizer(params, "adamw", 1e-4, 0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, seq + 1), generator=g)
    # every position a completion token: the model's worst case, as test_memory_model's rows
    mask = torch.ones(2, seq, dtype=torch.bool)
    b = Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask)

    def step() -> None:
        eng.step(model, b, 1 if obj != "sft" else b.n_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    peak = measure_peak(
        step, weights=list(model.buffers()), adapter=lambda: adapter_tensors(params, opt)
    )
    return peak["total"]


@pytest.mark.parametrize(
    "engine,family,seq,quant,obj",
    [
        pytest.param("mesp", "qwen2", 64, None, "dpo", id="mesp-qwen2-dpo"),
        # a second engine, family, base and objective: slow (tracked steps cost seconds each)
        pytest.param(
            "mebp", "gemma3", 64, Q4, "orpo", id="mebp-gemma3-orpo", marks=pytest.mark.slow
        ),
    ],
)
def test_predicted_preference_peak_matches_measured(
    engine: str, family: str, seq: int, quant: QuantSpec, obj: str
) -> None:
    cfg = small_config(family)
    got, sft = measure(cfg, engine, seq, quant, obj), measure(cfg, engine, seq, quant, "sft")
    p = predict(cfg, engine, seq, 2, 8, quant=quant, objective=obj)
    assert p["objective"] == obj
    assert abs(int(p["total"]) / got - 1) <= 0.10, (p, got)  # test_memory_model's tolerance
    # what the objective adds over SFT on the same rows, modelled to the byte: no tape, only
    # the (B, S) fp32 weights (twice at mesp's chunked CE) and 3·B fp64 buffers
    q = predict(cfg, engine, seq, 2, 8, quant=quant)
    assert p["peak_at"] == q["peak_at"] == "cross-entropy"
    assert int(p["total"]) - int(q["total"]) == got - sft
    assert 0 < got - sft < 0.001 * sft


def test_preference_needs_pairs_and_a_gradient() -> None:
    cfg = shape_config("qwen2.5-0.5b")
    with pytest.raises(MespError, match="gradient engine"):
        predict(cfg, "mezo", 256, 2, objective="dpo")
    with pytest.raises(MespError, match="pairs"):
        predict(cfg, "mesp", 256, 3, objective="dpo")
    with pytest.raises(MespError, match="unknown objective"):
        predict(cfg, "mesp", 256, 2, objective="kto")


def _plan(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    ns = parser.parse_args(["plan", "--json", *argv])
    return ns, ns.run


def test_plan_counts_pairs_and_drops_mezo(capsys: pytest.CaptureFixture) -> None:
    base = ["--model", "qwen2.5-0.5b", "--memory", "2GB", "--seq-len", "256", "--quantize", "4"]
    ns, run = _plan([*base, "--objective", "dpo", "--batch-size", "2"])
    assert run(ns) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["objective"] == "dpo" and p["batch"] == 4  # 2 pairs: 4 rows
    assert set(p["engines"]) == {"bp", "mebp", "mesp"}
    cfg = shape_config("qwen2.5-0.5b")
    for eng, r in p["engines"].items():
        want = Run(256, 4, 8, quant=Q4, objective="dpo").predict(cfg, eng)["total"]
        assert r["total"] == want
        assert r["total"] > Run(256, 4, 8, quant=Q4).predict(cfg, eng)["total"]
    ns, run = _plan([*base, "--objective", "orpo"])
    run(ns)
    capsys.readouterr()
    ns.json = False
    run(ns)
    assert "batch 2 rows (1 orpo pair)" in capsys.readouterr().out


def test_max_memory_knows_the_objective() -> None:
    """--max-memory: a budget mezo would fit but mesp not names no mezo under DPO (mezo does
    not train it); the planner's peak is the DPO step's."""
    from mesp.data import DataConfig
    from mesp.loading.session import ModelOptions
    from mesp.training.budget import check_budget
    from mesp.training.config import TrainConfig

    opts = ModelOptions(model="random:qwen2.5-0.5b", quantize="4")
    data, lora = DataConfig(seq_len=256), LoraConfig(rank=8)
    rows = TrainConfig(batch_size=2)  # one pair: what mesp train passes for --batch-size 1
    cfg = shape_config("qwen2.5-0.5b")
    dpo = int(Run(256, 2, 8, quant=Q4, objective="dpo").predict(cfg, "mesp")["total"])
    sft = int(Run(256, 2, 8, quant=Q4).predict(cfg, "mesp")["total"])
    assert dpo > sft
    assert check_budget(f"{dpo}B", opts, "mesp", data, lora, rows, "dpo") == dpo
    with pytest.raises(MespError, match="needs about"):
        check_budget(f"{dpo - 1}B", opts, "mesp", data, lora, rows, "dpo")
    mezo = int(Run(256, 2, 8, quant=Q4).predict(cfg, "mezo")["total"])
    with pytest.raises(MespError) as e:
        check_budget(f"{mezo}B", opts, "mesp", data, lora, rows, "dpo")
    assert "mezo" not in str(e.value)
    with pytest.raises(MespError, match="--engine mezo"):
        check_budget(f"{mezo}B", opts, "mesp", data, lora, rows)
