"""`mesp train --keep-best / --early-stop N`: best/ holds the adapter that scored the best
validation loss (read back by `mesp eval`), the run stops N validations after it, both survive
a SIGKILL + --resume bit for bit; loss.png starts at the validation before training.

The data makes validation worth watching: it trains on verse and validates on other text, so
the validation loss falls while the shared byte tokens are learned, then rises."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mesp.cli import main
from mesp.training.best import BEST_DIR, BEST_JSON, read_best
from mesp.training.checkpoint import load_state
from mesp.training.plot import loss_series
from tests.test_resume import KILL_AFTER
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

# a constant schedule: a run cut short by --steps and resumed longer is the uninterrupted run
FLAGS = dict(quantize="none", seq_len=48, batch_size=2, eval_batches=1, lr="2e-2", rank=2)
FLAGS |= dict(warmup=0, schedule="constant", eval_every=1, save_every=1, steps=40)
ADAPTER = ("adapter_model.safetensors", "adapter_config.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("best")
    data = root / "data"
    data.mkdir()
    make_jsonl(data / "train.jsonl", 24)
    rows = [{"text": f"0123456789 {i} qwxz jkv"} for i in range(8)]
    (data / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return make_model_dir(root / "m", "llama"), data


def _argv(tiny: tuple[Path, Path], out: Path, *extra: str, **flags: object) -> list[str]:
    return train_argv(*tiny, out, *extra, **{**FLAGS, **flags})


def _valid_rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if "valid_loss" in r]


def test_keeps_the_best_and_stops_early(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import mesp.training.loop

    plotted: list[dict] = []
    real = mesp.training.loop.plot_losses

    def plot(path: Path, losses: list, valid: list, baseline: dict | None = None) -> None:
        plotted.append(loss_series(losses, valid, baseline))
        real(path, losses, valid, baseline)

    monkeypatch.setattr(mesp.training.loop, "plot_losses", plot)
    out = tmp_path / "out"
    assert main(_argv(tiny, out, "--keep-best", "--early-stop", "2")) == 0
    said = capsys.readouterr().out
    valid = _valid_rows(out)
    losses = [r["valid_loss"] for r in valid]
    best = read_best(out)
    assert best is not None and best["valid_loss"] == min(losses)
    stop = valid[-1]["step"]
    # stopped two validations after the best, before --steps; the final adapter is that step's
    assert stop == best["step"] + 2 < FLAGS["steps"]
    assert all(x > best["valid_loss"] for x in losses[-2:])
    st = load_state(out)
    assert (st.step, st.best_step, st.best_loss, st.since_best) == (
        stop,
        best["step"],
        min(losses),
        2,
    )
    line = [x for x in said.splitlines() if "early stop" in x]
    assert len(line) == 1 and f"at step {stop}" in line[0] and str(out / BEST_DIR) in line[0]
    # log.jsonl (and TensorBoard) get the best loss each time it changes, and only then
    assert [r["step"] for r in valid if "valid_best_loss" in r] == [
        r["step"]
        for i, r in enumerate(valid)
        if r["valid_loss"] < min(losses[:i], default=math.inf)
    ]
    # best/ is a PEFT adapter that scores what best.json says; the final one scores worse
    scores = {}
    for name, adapter in (("best", out / BEST_DIR), ("final", out)):
        argv = ["eval", "--model", str(tiny[0]), "--data", str(tiny[1]), "--adapter", str(adapter)]
        argv += ["--quantize", "none", "--seq-len", "48", "--batch-size", "2"]
        assert main([*argv, "--max-batches", "1", "--json"]) == 0
        scores[name] = json.loads(capsys.readouterr().out)["loss"]
    assert scores["best"] == pytest.approx(best["valid_loss"], rel=1e-6)
    assert (
        scores["final"] == pytest.approx(losses[-1], rel=1e-6) and scores["final"] > scores["best"]
    )
    # loss.png: the validation before training is its step 0 (item 6 of issue 31)
    before = json.loads((out / "summary.json").read_text())["valid_ppl_before"]
    steps, points = plotted[0]["valid"]
    assert steps == [0, *[r["step"] for r in valid]]
    assert math.exp(points[0]) == pytest.approx(before, rel=1e-9) and points[1:] == losses


def _same_outputs(ref: Path, out: Path) -> None:
    for d, f in [(BEST_DIR, f) for f in (*ADAPTER, BEST_JSON)] + [(".", f) for f in ADAPTER]:
        assert (ref / d / f).read_bytes() == (out / d / f).read_bytes(), f"{d}/{f} differs"


def test_early_stop_and_keep_best_survive_resume(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run ended with one validation without improvement counted (the stop needs two) and
    resumed: it stops at the uninterrupted run's step with its best/ and final adapter, byte
    for byte. A resume that lost the count would stop one validation later; one that lost the
    best loss would take its first validation for a new best."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    flags = ("--keep-best", "--early-stop", "2")
    assert main(_argv(tiny, ref, *flags)) == 0
    best, stop = read_best(ref), _valid_rows(ref)[-1]["step"]
    assert best is not None and stop == best["step"] + 2
    assert main(_argv(tiny, out, *flags, steps=stop - 1)) == 0
    st = load_state(out)
    assert (st.step, st.best_step, st.since_best) == (stop - 1, best["step"], 1)
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", str(FLAGS["steps"])]) == 0
    assert f"early stop at step {stop}" in capsys.readouterr().out
    _same_outputs(ref, out)
    # an early-stopped run resumed as it was trains no further; a larger N continues it
    assert main(["train", "--resume", str(out)]) == 0
    assert load_state(out).step == stop
    assert main(["train", "--resume", str(out), "--early-stop", "3", "--steps", str(stop + 3)]) == 0
    st = load_state(out)
    assert st.step > stop and (st.since_best == 3 or st.step == stop + 3)


@pytest.mark.slow
def test_early_stop_and_keep_best_survive_sigkill_and_resume(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """As above with the cosine schedule and a SIGKILL: a crash, not a shorter run."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    flags = ("--keep-best", "--early-stop", "2", "--schedule", "cosine")
    r = subprocess.run(_argv(tiny, ref, *flags, python=True), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    best, stop = read_best(ref), _valid_rows(ref)[-1]["step"]
    assert best is not None and stop == best["step"] + 2
    kill = stop - 1  # after the validation at best + 1, before the one at best + 2
    argv = [sys.executable, "-c", KILL_AFTER, *_argv(tiny, out, *flags)]
    env = {**os.environ, "MESP_TEST_KILL_AFTER": str(kill)}
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    st = load_state(out)
    assert (st.step, st.best_step, st.since_best) == (kill, best["step"], 1)
    r = subprocess.run(
        [sys.executable, "-m", "mesp", "train", "--resume", str(out), "--no-progress"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert f"early stop at step {stop}" in r.stdout, r.stdout
    _same_outputs(ref, out)


def test_refused_in_one_line_where_meaningless(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    cases = [
        (("--early-stop", "2", "--eval-every", "0"), "--eval-every 0"),
        (("--early-stop", "-1"), "--early-stop must be"),
    ]
    for extra, expect in cases:
        assert main(_argv(tiny, out, *extra)) == 2
        err = capsys.readouterr().err
        assert err.startswith("mesp: error:") and err.count("\n") == 1 and expect in err, err
    model, data = tiny
    for flag in ("--keep-best", "--early-stop=2"):  # no validation set at all
        argv = train_argv(model, data / "train.jsonl", out, flag, **{**FLAGS, "valid_fraction": 0})
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()  # after the data's truncation warning
        assert err[-1].startswith("mesp: error: --") and "needs a validation set" in err[-1]
        assert not (out / "log.jsonl").exists()


def test_a_fresh_run_drops_an_old_runs_best(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert main(_argv(tiny, out, "--keep-best", steps=2)) == 0
    best = read_best(out)
    assert best is not None and best["step"] in (1, 2)
    assert f"best adapter (step {best['step']}, " in capsys.readouterr().out
    assert main(_argv(tiny, out, steps=2)) == 0  # same directory, no --keep-best
    assert not (out / BEST_DIR).exists()


def test_loss_series_starts_at_the_baseline() -> None:
    valid = [{"step": 20, "loss": 3.0}, {"step": 40, "loss": 2.5}]
    s = loss_series([4.0, 3.5], valid, {"loss": 4.34, "ppl": 76.84})
    assert s["train"] == ([1, 2], [4.0, 3.5])
    assert s["valid"] == ([0, 20, 40], [4.34, 3.0, 2.5])
    assert loss_series([4.0], valid)["valid"] == ([20, 40], [3.0, 2.5])  # none measured
    assert "valid" not in loss_series([4.0], [], None)
