"""Gradient-quality analysis (MeZO vs exact), the mesp-vs-mezo convergence run, and the
`mesp plan` / `mesp analyze-grads` commands."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from mesp.batch import Example
from mesp.bench.convergence import convergence
from mesp.bench.grads import analyze_grads, exact_gradient, write_analysis
from mesp.cli.plan import add_parser
from mesp.engines import make_engine
from mesp.errors import MespError
from mesp.lora import LoraConfig
from mesp.memory.plan import parse_bytes
from mesp.training import TrainConfig
from tests.engine_cases import grads_of, model_with_adapter, padded_batch
from tests.tiny_dir import make_jsonl, make_model_dir


def _cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd", required=True))
    ns = p.parse_args(argv)
    return ns.run(ns)


def test_exact_gradient_is_mesp_flattened_in_mezo_order() -> None:
    model = model_with_adapter("qwen2")
    batch = padded_batch()
    _, g = grads_of(make_engine("mesp"), model, batch)
    flat = exact_gradient(model, batch)
    want = torch.cat([g[n].flatten() for n, p in model.named_parameters() if p.requires_grad])
    assert torch.equal(flat, want)
    assert all(p.grad is None for p in model.lora_parameters())


def test_analyze_grads_cosines(tmp_path: Path) -> None:
    model = model_with_adapter("llama", dtype=torch.float64)
    batches = [padded_batch(seed=1), padded_batch(seed=2)]
    res = analyze_grads(model, batches, samples_list=(1, 16), eps=1e-4)
    d = sum(p.numel() for p in model.lora_parameters())
    assert res["dimension"] == d and res["samples"] == [1, 16]
    assert len(res["batches"]) == 2
    assert res["theory_single_abs_cos"] == pytest.approx(math.sqrt(2 / (math.pi * d)))
    for row in res["batches"]:
        assert row["grad_norm"] > 0
        assert all(-1 <= c <= 1 for c in row["cos_by_n"].values())
    # d ≈ 6.6k: sixteen probes align better than one does on average (√16 ≈ 4× in theory)
    assert res["mean_cos_by_n"]["16"] > 2 * res["mean_single_abs_cos"]
    js, png = write_analysis(res, tmp_path)
    assert json.loads(js.read_text())["samples"] == [1, 16]
    assert png.stat().st_size > 1000
    with pytest.raises(MespError):
        analyze_grads(model, [], samples_list=(1,))


def test_convergence_writes_json_and_png(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)

    def rows(n: int) -> list[Example]:
        return [
            Example(torch.randint(0, 211, (20,), generator=g).tolist(), [0] + [1] * 19)
            for _ in range(n)
        ]

    train, valid = rows(8), rows(2)
    cfg = TrainConfig(
        steps=2, batch_size=2, eval_every=1, eval_batches=1, save_every=0, warmup=0, progress=False
    )
    res = convergence(
        lambda: model_with_adapter("qwen2"),
        train,
        valid,
        cfg,
        LoraConfig(rank=3, alpha=7.0),
        tmp_path,
        engine_opts={"mezo": {"lr": 1e-4}},
    )
    assert set(res["runs"]) == {"mesp", "mezo"}
    for r in res["runs"].values():
        assert r["steps"] == [0, 1, 2] and len(r["valid_loss"]) == 3
        assert r["seconds"][0] == 0 and r["seconds"][-1] > 0
    assert json.loads((tmp_path / "convergence.json").read_text())["engines"] == ["mesp", "mezo"]
    assert (tmp_path / "convergence.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "text,value",
    [
        ("500MB", 500 * 10**6),
        ("8GB", 8 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("4096", 4096),
        ("64 KiB", 65536),
        ("2g", 2 * 10**9),
        ("0.5TB", 5 * 10**11),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "MB", "8XB", "-1GB", "0MB", "1.2.3GB", "5i", "eight GB"])
def test_parse_bytes_rejects(bad: str) -> None:
    with pytest.raises(MespError, match="memory size"):
        parse_bytes(bad)


def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["plan", "--memory", "1GB", "--model", "qwen2.5-0.5b", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    tot = {e: r["total"] for e, r in plan["engines"].items()}
    assert tot["mezo"] < tot["mesp"] < tot["mebp"] < tot["bp"]
    assert plan["engines"]["mesp"]["fits"] and not plan["engines"]["bp"]["fits"]
    longest = {e: r["longest_seq"] for e, r in plan["engines"].items()}
    assert longest["bp"] < longest["mebp"] < longest["mesp"] <= longest["mezo"]
    assert plan["engines"]["mesp"]["largest_model"] == "qwen2.5-0.5b"


def test_plan_command_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        _cli(
            [
                "plan",
                "--memory",
                "8GB",
                "--model",
                "random:llama-3.2-1b",
                "--dtype",
                "bfloat16",
                "--optimizer",
                "sgd",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "llama-3.2-1b" in out and all(e in out for e in ("bp", "mebp", "mesp", "mezo"))
    with pytest.raises(MespError, match="memory size"):
        _cli(["plan", "--memory", "lots"])
    with pytest.raises(MespError, match="unknown model shape|no such file"):
        _cli(["plan", "--model", "random:qwen9"])
    with pytest.raises(MespError, match="--seq-len must be positive"):
        _cli(["plan", "--seq-len", "0"])


def test_analyze_grads_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_model_dir(tmp_path / "m", "qwen2")
    data = make_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "out"
    argv = [
        "analyze-grads",
        "--model",
        str(model),
        "--quantize",
        "none",
        "--data",
        str(data),
        "--batches",
        "2",
        "--seq-len",
        "32",
        "--samples",
        "1,2",
        "--out",
        str(out),
    ]
    assert _cli(argv) == 0
    assert "mean cosine" in capsys.readouterr().out
    res = json.loads((out / "grad_cosines.json").read_text())
    assert res["samples"] == [1, 2] and len(res["batches"]) == 2
    assert (out / "grad_cosines.png").exists()
    with pytest.raises(MespError, match="--samples"):
        _cli([*argv[:-4], "--samples", "one", "--out", str(out)])


def test_directional_probes_agree_with_forward_probes() -> None:
    model = model_with_adapter("qwen3", dtype=torch.float64)
    batches = [padded_batch()]
    fwd = analyze_grads(model, batches, (1, 3), eps=1e-5)
    ideal = analyze_grads(model, batches, (1, 3), eps=1e-5, directional=True)
    assert ideal["probe"] != fwd["probe"]
    for n in ("1", "3"):
        assert ideal["mean_cos_by_n"][n] == pytest.approx(fwd["mean_cos_by_n"][n], rel=1e-5)
