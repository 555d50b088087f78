"""DP-SGD on the device (runtime/src/private.h; mesp/ondevice/private.py).

- The native accountant (a C++ port) equals dp-accounting's ε, and its σ search the Python
  driver's; the native generator equals the driver's value for value, and its uniforms and
  normals have the moments they should.
- At noise 0 and sampling rate 1 both drivers equal the engine's DP-SGD (PrivateEngine, the
  clipping tests/test_dp_clipping.py checks against per-example autograd), per-layer and flat.
- With noise and Poisson sampling the native runner equals the Python driver (the same sample,
  the same noise), and the noise is the generator's N(0, σ²C²) / E exactly.
- ε per step, privacy.json, and one-line refusals of bad flags.
Exports: the tiny 4-bit Qwen2 the other on-device tests share (tests/et_cases.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mesp.accountant import bisect_noise, epsilon
from mesp.batch import Example, collate
from mesp.engines import make_engine
from mesp.engines.private import PrivateEngine
from mesp.ondevice import et_driver, runner
from mesp.ondevice.private import DpStream
from tests import export_cases as T

pytest.importorskip("dp_accounting")
ROOT = Path(__file__).resolve().parent.parent
LR = 0.05


@pytest.fixture(scope="session")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/dp_probe.cpp built against runtime/src/private.cpp (no ExecuTorch needed)."""
    out = tmp_path_factory.mktemp("dp") / "dp_probe"
    src = [ROOT / "tests" / "dp_probe.cpp", ROOT / "runtime" / "src" / "private.cpp"]
    cmd = ["g++", "-O2", "-std=c++17", f"-I{ROOT / 'runtime' / 'src'}", "-o", str(out)]
    r = subprocess.run([*cmd, *map(str, src)], capture_output=True, text=True)
    if r.returncode != 0 and "not found" in r.stderr:
        pytest.skip("no C++ compiler")
    assert r.returncode == 0, r.stderr
    return out


def _ask(probe: Path, *args: object) -> list[float]:
    r = subprocess.run([str(probe), *map(str, args)], capture_output=True, text=True, check=True)
    return [float(x) for x in r.stdout.split()]


@pytest.mark.parametrize(
    "q,sigma,steps,delta",
    [
        (0.01, 1.0, 1000, 1e-5),
        (0.004, 0.8, 2500, 1e-6),
        (0.1, 2.0, 50, 1e-5),
        (1.0, 5.0, 10, 1e-3),
        (0.5, 0.6, 3, 1e-2),
        (0.02, 3.0, 100000, 1e-7),
    ],
)
def test_native_accountant_equals_dp_accounting(probe: Path, q, sigma, steps, delta) -> None:  # type: ignore[no-untyped-def]
    (got,) = _ask(probe, "eps", q, sigma, steps, delta)
    assert got == pytest.approx(epsilon(q, sigma, steps, delta), rel=1e-9)


@pytest.mark.parametrize("eps,q,steps,delta", [(8.0, 0.01, 1000, 1e-5), (1.0, 0.2, 20, 1e-5)])
def test_native_noise_search_equals_the_drivers(probe: Path, eps, q, steps, delta) -> None:  # type: ignore[no-untyped-def]
    (got,) = _ask(probe, "solve", eps, q, steps, delta)
    want = bisect_noise(eps, q, steps, delta)
    assert got == pytest.approx(want, rel=1e-9)
    assert epsilon(q, got, steps, delta) <= eps < epsilon(q, got * (1 - 1e-5), steps, delta)
    assert _ask(probe, "solve", 1e-4, 1.0, 2, 1e-5) == [-1.0]  # above σ = 1000: refused


def test_native_generator_equals_the_drivers(probe: Path) -> None:
    for seed, step, purpose in [(0, 1, 0), (7, 3, 5), (2**40 + 1, 1000, 123)]:
        s = DpStream(seed, step, purpose)
        np.testing.assert_array_equal(
            _ask(probe, "uniform", seed, step, purpose, 64), s.uniform(64)
        )
        np.testing.assert_allclose(
            _ask(probe, "normal", seed, step, purpose, 63), s.normal(63), rtol=0, atol=1e-14
        )


def test_generator_moments() -> None:
    u = DpStream(1, 1, 0).uniform(1_000_000)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 1e-3
    assert abs(u.var() - 1 / 12) < 1e-3
    z = DpStream(1, 1, 1).normal(1_000_001)
    assert abs(z.mean()) < 3e-3 and abs(z.std() - 1) < 3e-3
    assert abs(float(np.mean(z**4)) - 3) < 0.03  # Gaussian tails, not just two moments
    assert not np.array_equal(DpStream(1, 2, 1).normal(8), z[:8])  # another step, other noise


# ---- the drivers ----


def _dp_argv(clip: float, noise: float, batch: float, clipping: str, seed: int = 0) -> list[str]:
    return [
        "--dp-clip",
        repr(clip),
        "--dp-noise",
        repr(noise),
        "--dp-batch",
        repr(batch),
        "--dp-clipping",
        clipping,
        "--seed",
        str(seed),
    ]


def _driver(case, rows, steps: int, argv: list[str]):  # type: ignore[no-untyped-def]
    """The Python driver with DP flags parsed as `mesp run-artifacts` parses them."""
    import argparse

    p = argparse.ArgumentParser()
    runner.add_arguments(p)
    ns = p.parse_args([str(case.dir), "--data", "x", "--steps", str(steps), "--out", "y", *argv])
    plan = runner.private.DpPlan.resolve(ns, len(rows), steps, case.art.batch_size)
    notes: list[str] = []
    trainer, losses = et_driver.train(
        case.art,
        rows,
        runner.RunConfig(steps, LR, "sgd", dp=plan),
        lambda k, loss, note: notes.append(note),
    )
    return trainer, losses, notes, plan


def _native(runner_bin: Path, case, rows, tmp: Path, steps: int, argv: list[str]):  # type: ignore[no-untyped-def]
    data, out, log = T._write_jsonl(tmp / "rows.jsonl", rows), tmp / "a", tmp / "log.jsonl"
    cmd = [
        str(runner_bin),
        str(case.dir),
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--lr",
        repr(LR),
        "--out",
        str(out),
        "--json-log",
        str(log),
        *argv,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout, [json.loads(x) for x in log.read_text().splitlines()], out


def _engine(case, rows, steps: int, clip: float, clipping: str) -> tuple[list[float], dict]:  # type: ignore[type-arg]
    """mesp's engine under PrivateEngine, every row each step (q = 1), noise 0, / E = N, SGD."""
    case.reset()
    eng = PrivateEngine(make_engine("mesp", vocab_chunk=case.vchunk), clip, clipping)
    params = case.model.lora_parameters()
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for _ in range(steps):
        batch = collate([Example(i, m) for i, m in rows])
        losses.append(eng.step(case.model, batch, 1) / len(rows))
        for p in params:
            p.grad = p.grad / float(len(rows))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: p.detach().clone() for k, p in case.model.named_parameters()}


@pytest.mark.parametrize("clipping", ["per-layer", "flat"])
def test_noise_zero_equals_the_engine(et_cases, runner_bin, tmp_path: Path, clipping: str) -> None:  # type: ignore[no-untyped-def]
    case, rows, steps = et_cases("qwen2", "q4"), T._rows(), 3
    clip = 0.05 if clipping == "per-layer" else 0.2
    argv = _dp_argv(clip, 0.0, len(rows), clipping)  # q = 1: every row, every step
    trainer, losses, notes, plan = _driver(case, rows, steps, argv)
    assert plan.q == 1.0 and plan.expected == len(rows)
    assert all(n.startswith(f" rows {len(rows)} epsilon inf") for n in notes)
    ref, params = _engine(case, rows, steps, clip, clipping)
    _, free = _engine(case, rows, steps, 1e9, clipping)  # the bound binds (else no clip tested)
    assert max(float((params[k] - free[k]).abs().max()) for k in free if "lora" in k) > 1e-3
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= 1e-5, (losses, ref)
    _, log, out = _native(runner_bin, case, rows, tmp_path, steps, argv)
    got = load_file(out / "adapter_model.safetensors")
    for i, lora in enumerate(trainer.lora):
        for k, p in lora.items():
            want = params[f"model.layers.{i}.{k}"]
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-7)
            native = got[f"{runner.PEFT_PREFIX}model.layers.{i}.{k}.weight"]
            torch.testing.assert_close(native, p, rtol=0, atol=1e-6)
    assert max(abs(s["loss"] - a) for s, a in zip(log, losses, strict=True)) <= 1e-6


def test_noise_and_sampling_native_equals_driver(et_cases, runner_bin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Poisson sampling (q = 0.4) and noise σ = 1.5: the same rows and the same adapter; the
    noise is the generator's, scaled by σC / E; ε per step is the accountant's."""
    case, rows, steps, clip, sigma, seed = et_cases("qwen2", "q4"), T._rows(), 4, 0.1, 1.5, 11
    argv = _dp_argv(clip, sigma, 2.0, "per-layer", seed)
    trainer, losses, notes, plan = _driver(case, rows, steps, argv)
    stdout, log, out = _native(runner_bin, case, rows, tmp_path, steps, argv)
    picks = [int((DpStream(seed, k, 0).uniform(len(rows)) < 0.4).sum()) for k in range(1, 5)]
    assert [s["rows"] for s in log] == picks and len(set(picks)) > 1  # a variable batch
    for k, (s, note) in enumerate(zip(log, notes, strict=True), 1):
        eps = epsilon(0.4, sigma, k, 1e-5)
        assert s["epsilon"] == pytest.approx(eps, rel=1e-9)
        assert note == f" rows {picks[k - 1]} epsilon {eps:.6f}"
    lines = stdout.splitlines()
    assert lines[0].endswith(f" rows {picks[0]} epsilon {log[0]['epsilon']:.6f}"), lines[0]
    assert lines[-2].startswith("DP-SGD: epsilon = ") and "privacy.json" in lines[-2], lines
    got = load_file(out / "adapter_model.safetensors")
    for i, lora in enumerate(trainer.lora):
        for k, p in lora.items():
            native = got[f"{runner.PEFT_PREFIX}model.layers.{i}.{k}.weight"]
            torch.testing.assert_close(native, p, rtol=0, atol=1e-6)
    priv = json.loads((out / "privacy.json").read_text())
    assert priv["epsilon"] == pytest.approx(epsilon(0.4, sigma, steps, 1e-5), rel=1e-9)
    assert (priv["sigma"], priv["q"], priv["clip"], priv["expected"]) == (sigma, 0.4, clip, 2.0)
    assert priv["delta"] == 1e-5 and priv["clipping"] == "per-layer" and priv["steps"] == steps

    # One step, noise against none (the same sample): the difference is -lr z / E exactly, z the
    # generator's σC·N(0, 1) in the tensors' order.
    quiet, _, _, _ = _driver(case, rows, 1, _dp_argv(clip, 0.0, 2.0, "per-layer", seed))
    noisy, _, _, _ = _driver(case, rows, 1, argv)
    t, zs = 0, []
    for d0, d1 in zip(quiet.lora, noisy.lora, strict=True):
        for key in d0:
            z = DpStream(seed, 1, 1 + t).normal(d0[key].numel()) * (sigma * clip)
            want = -LR * torch.from_numpy(z.astype(np.float32)).view(d0[key].shape) / 2.0
            torch.testing.assert_close(d1[key] - d0[key], want, rtol=1e-3, atol=1e-7)
            zs.append(z)
            t += 1
    z = np.concatenate(zs) / (sigma * clip)
    assert z.size > 5000 and abs(z.std() - 1) < 0.05


def test_epsilon_target_solves_sigma(et_cases, runner_bin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    case, rows = et_cases("qwen2", "q4"), T._rows()
    argv = ["--dp-clip", "1", "--dp-epsilon", "30", "--dp-batch", "2", "--dp-clipping", "flat"]
    _, log, out = _native(runner_bin, case, rows, tmp_path, 2, argv)
    priv = json.loads((out / "privacy.json").read_text())
    assert priv["sigma"] == pytest.approx(bisect_noise(30.0, 0.4, 2, 1e-5), rel=1e-9)
    assert priv["epsilon"] <= 30.0 and log[-1]["epsilon"] == pytest.approx(priv["epsilon"])


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--dp-noise", "1"], "need --dp-clip"),
        (["--dp-clip", "0", "--dp-noise", "1"], "--dp-clip must be a positive"),
        (["--dp-clip", "1", "--dp-noise", "-1"], "--dp-noise must be 0 or more"),
        (["--dp-clip", "1", "--dp-noise", "1", "--dp-delta", "1"], "--dp-delta must be in (0, 1)"),
        (["--dp-clip", "1", "--dp-epsilon", "0"], "--dp-epsilon must be positive"),
        (["--dp-clip", "1"], "one of --dp-noise"),
        (["--dp-clip", "1", "--dp-noise", "1", "--dp-epsilon", "2"], "one of --dp-noise"),
        (["--dp-clip", "1", "--dp-noise", "1", "--dp-batch", "0"], "--dp-batch must be"),
        (["--dp-clip", "1", "--dp-epsilon", "1e-4"], "cannot be met"),
        (["--seed", "3"], "--seed needs --dp-clip"),
    ],
)
def test_bad_dp_flags_one_line(et_cases, runner_bin, tmp_path: Path, argv, needle, capsys) -> None:  # type: ignore[no-untyped-def]
    """Both drivers: one line, exit code 2, no adapter."""
    case = et_cases("qwen2", "q4")
    data, out = T._write_jsonl(tmp_path / "rows.jsonl", T._rows()), tmp_path / "a"
    base = [str(case.dir), "--data", str(data), "--steps", "2", "--out", str(out)]
    r = subprocess.run([str(runner_bin), *base, *argv], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("mesp-runner: error: ") and needle in r.stderr, r.stderr
    assert et_driver.main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and needle in err.replace("δ", "delta"), err
    assert not out.exists()


def test_bad_clipping_value_one_line(et_cases, runner_bin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    case = et_cases("qwen2", "q4")
    data, out = T._write_jsonl(tmp_path / "rows.jsonl", T._rows()), tmp_path / "a"
    argv = [
        str(case.dir),
        "--data",
        str(data),
        "--steps",
        "1",
        "--out",
        str(out),
        "--dp-clip",
        "1",
        "--dp-noise",
        "1",
        "--dp-clipping",
        "each",
    ]
    r = subprocess.run([str(runner_bin), *argv], capture_output=True, text=True)
    assert r.returncode == 2 and "--dp-clipping must be per-layer or flat" in r.stderr
    assert not out.exists()
