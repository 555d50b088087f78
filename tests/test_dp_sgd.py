"""DP-SGD around the clipping (tests/test_dp_clipping.py): the accountant against Opacus's, the
noise's scale, Poisson sampling, one training step against its definition, a resume that stays
bit-identical, and one-line refusals of bad settings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mesp.batch import Example, collate
from mesp.cli import main
from mesp.engines import make_engine
from mesp.engines.private import PrivateEngine
from mesp.training.privacy import DPSGD, PrivacyConfig, epsilon, solve_noise
from tests.engine_cases import model_with_adapter
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

pytest.importorskip("dp_accounting")

CASES = [
    (0.01, 1.0, 1000, 1e-5),
    (0.004, 0.8, 2500, 1e-6),
    (0.1, 2.0, 50, 1e-5),
    (1.0, 5.0, 10, 1e-3),
]


@pytest.mark.parametrize("q,sigma,steps,delta", CASES)
def test_epsilon_equals_opacus(q: float, sigma: float, steps: int, delta: float) -> None:
    """dp-accounting's RDP ε against Opacus's RDP accountant for the same (q, σ, steps, δ)."""
    opacus = pytest.importorskip("opacus.accountants")
    acc = opacus.RDPAccountant()
    acc.history = [(sigma, q, steps)]
    ref = acc.get_epsilon(delta)
    assert epsilon(q, sigma, steps, delta) == pytest.approx(ref, rel=1e-3)


def test_solved_noise_meets_the_target() -> None:
    q, steps, delta = 0.01, 500, 1e-5
    sigma = solve_noise(8.0, q, steps, delta)
    assert 7.9 <= epsilon(q, sigma, steps, delta) <= 8.0
    assert epsilon(q, sigma * 0.97, steps, delta) > 8.0  # not more noise than needed
    assert epsilon(q, 0.0, 3, delta) == math.inf and epsilon(q, 1.0, 0, delta) == 0.0


def test_noise_scale_and_seeding() -> None:
    """privatize: (sum + N(0, σ²C²)) / E, seeded by (seed, step)."""
    dp = DPSGD(clip=0.7, sigma=1.3, q=0.1, delta=1e-5, clipping="flat", expected=5.0, seed=3)
    p = torch.nn.Parameter(torch.zeros(1000, 1000))
    p.grad = torch.full_like(p, 2.0)
    dp.privatize([p], step=4)
    got = p.grad.double()
    assert float(got.mean()) == pytest.approx(2.0 / 5.0, abs=3e-3)
    assert float(got.std()) == pytest.approx(1.3 * 0.7 / 5.0, rel=5e-3)
    q = torch.nn.Parameter(torch.zeros(1000, 1000))
    q.grad = torch.full_like(q, 2.0)
    dp.privatize([q], step=4)
    assert torch.equal(p.grad, q.grad)  # the same step draws the same noise
    q.grad = torch.full_like(q, 2.0)
    dp.privatize([q], step=5)
    assert not torch.equal(p.grad, q.grad)
    empty = torch.nn.Parameter(torch.zeros(3))  # no gradient (an empty sample): noise alone
    dp.privatize([empty], step=1)
    assert empty.grad is not None and bool((empty.grad != 0).all())


def test_poisson_sampling() -> None:
    rows = [Example(list(range(5 + i % 3)), [0] + [1] * (4 + i % 3)) for i in range(200)]
    dp = DPSGD(clip=1.0, sigma=1.0, q=0.05, delta=1e-5, clipping="flat", expected=10.0, seed=0)
    sizes = []
    for step in range(1, 401):
        micro = dp.sample(step, rows, micro=4, pad_id=0)
        assert all(b.input_ids.shape[0] <= 4 for b in micro)
        sizes.append(sum(b.input_ids.shape[0] for b in micro))
    assert sum(sizes) / len(sizes) == pytest.approx(10.0, rel=0.05)
    assert 0 in sizes or min(sizes) <= 3  # a variable batch
    again = dp.sample(7, rows, micro=4, pad_id=0)
    assert [b.input_ids.tolist() for b in again] == [
        b.input_ids.tolist() for b in dp.sample(7, rows, micro=4, pad_id=0)
    ]


def test_step_is_the_clipped_mean_plus_noise() -> None:
    """The gradient the optimizer sees: (Σ_e clip(g_e) + σC·z) / E, z the step's seeded draw."""
    model = model_with_adapter("qwen2")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 211, (9 + e,), generator=g).tolist() for e in range(3)]
    rows = [Example(x, [0] * 3 + [1] * (len(x) - 3)) for x in ids]
    params = model.lora_parameters()
    # mesp with noise: the clipped sum from bp (no noise) plus the draw, over E
    eng = PrivateEngine(make_engine("bp"), 0.05, "flat")
    eng.step(model, collate(rows), 0)
    clipped = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    dp = DPSGD(clip=0.05, sigma=0.5, q=1.0, delta=1e-5, clipping="flat", expected=3.0, seed=9)
    PrivateEngine(make_engine("mesp"), 0.05, "flat").step(model, collate(rows), 0)
    dp.privatize(params, step=2)
    z = torch.Generator().manual_seed((9 * 1_000_003 + 2 * 2 + 1) % 2**62)
    for p, c in zip(params, clipped, strict=True):
        want = (c + torch.randn(p.shape, generator=z) * 0.5 * 0.05) / 3.0
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dp")
    return make_model_dir(root / "m", "llama"), make_jsonl(root / "d.jsonl", 30)


def _argv(tiny: tuple[Path, Path], out: Path, *extra: str, steps: int = 4) -> list[str]:
    model, data = tiny
    return train_argv(
        model, data, out, "--dp-clip", "0.5", *extra, quantize="none", seq_len=32, batch_size=2,
        steps=steps, save_every=2, eval_every=0, eval_batches=1, lr="5e-3", rank=2, engine="mesp",
    )  # fmt: skip


def test_train_logs_epsilon_and_resumes_bit_identical(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(_argv(tiny, whole, "--dp-noise", "0.8")) == 0
    assert main(_argv(tiny, part, "--dp-noise", "0.8", steps=2)) == 0
    # another noise is another guarantee: refused in one line, nothing trained
    assert main(["train", "--resume", str(part), "--dp-noise", "0.5", "--no-progress"]) == 2
    assert main(["train", "--resume", str(part), "--steps", "4", "--no-progress"]) == 0
    a = load_file(str(whole / "adapter_model.safetensors"))
    b = load_file(str(part / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (whole / "log.jsonl").read_text().splitlines()]
    eps = [r["epsilon"] for r in rows if "epsilon" in r]
    assert len(eps) == 4 and eps == sorted(eps) and eps[0] > 0
    rec = json.loads((whole / "privacy.json").read_text())
    assert rec["epsilon"] == pytest.approx(eps[-1]) and rec["sigma"] == 0.8 and rec["steps"] == 4
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(eps[-1])


BAD = [
    (["--dp-noise", "1"], "--dp-clip"),  # (without --dp-clip: _argv adds it, so drop below)
    (["--dp-clip", "0", "--dp-noise", "1"], "--dp-clip must be a positive"),
    (["--dp-noise", "-1"], "--dp-noise must be 0 or more"),
    (["--dp-noise", "1", "--dp-delta", "1"], "--dp-delta must be in (0, 1)"),
    (["--dp-epsilon", "0"], "--dp-epsilon must be positive"),
    ([], "one of --dp-noise SIGMA or --dp-epsilon"),
    (["--dp-noise", "1", "--dp-epsilon", "3"], "one of --dp-noise SIGMA or --dp-epsilon"),
    (["--dp-epsilon", "1e-6"], "cannot be met"),
    (["--dp-noise", "1", "--engine", "mezo"], "mezo forms none"),
    (["--dp-noise", "1", "--nproc", "2"], "one process"),
]


@pytest.mark.parametrize("extra,message", BAD)
def test_bad_settings_one_line(
    tiny, tmp_path: Path, capsys, extra: list[str], message: str
) -> None:  # type: ignore[no-untyped-def]
    argv = _argv(tiny, tmp_path / "o", *extra)
    if extra[:1] == ["--dp-noise"] and message == "--dp-clip":
        argv.remove("--dp-clip")
        argv.remove("0.5")
    if extra[:1] == ["--dp-clip"]:
        i = argv.index("--dp-clip")
        del argv[i : i + 2]  # the case's own --dp-clip, not _argv's
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_dp_refuses_a_preference_objective() -> None:
    from mesp.engines.objective import Objective

    with pytest.raises(Exception, match="--objective sft only"):
        PrivateEngine(make_engine("mesp", objective=Objective("dpo")), 1.0, "flat")


def test_config_defaults_off() -> None:
    assert not PrivacyConfig().on


def test_grad_writes_the_clipped_mean(tiny, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`mesp grad --dp-clip C --dp-noise 0`: (Σ clipped) / B, and bp's equals mesp's; the noise
    changes it; --dp-epsilon needs a run."""
    model, data = tiny
    base = ["grad", "--model", str(model), "--data", str(data), "--quantize", "none"]
    base += ["--seq-len", "32", "--batch-size", "3", "--rank", "2", "--init-b", "0.05"]
    got = {}
    for engine, noise in (("bp", "0"), ("mesp", "0"), ("mesp", "2")):
        out = tmp_path / f"{engine}{noise}.safetensors"
        argv = [*base, "--engine", engine, "--dp-clip", "0.01", "--dp-noise", noise]
        assert main([*argv, "--dp-clipping", "flat", "--out", str(out)]) == 0
        got[engine, noise] = load_file(str(out))
    for k, v in got["bp", "0"].items():
        torch.testing.assert_close(got["mesp", "0"][k], v, rtol=1e-5, atol=1e-9)
    norm = math.sqrt(sum(float(v.double().square().sum()) for v in got["bp", "0"].values()))
    assert norm <= 0.01 + 1e-9  # the mean of three gradients each of norm <= C
    assert any(not torch.equal(got["mesp", "2"][k], v) for k, v in got["mesp", "0"].items())
    capsys.readouterr()
    argv = [*base, "--dp-clip", "1", "--dp-epsilon", "3", "--out", str(tmp_path / "e.st")]
    assert main(argv) == 2
    assert "needs a run" in capsys.readouterr().err
