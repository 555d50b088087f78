"""`mesp generate`'s repetition penalty: CTRL's rule on the logits, and what it does to decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesp.cli import main
from mesp.inference.generate import generate, penalize
from mesp.loading import load_model
from tests.tiny_dir import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("m") / "tiny", "llama")


def test_penalize_divides_positive_and_multiplies_negative_scores() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    out = penalize(logits, {0, 1, 4}, 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the caller's tensor is left alone
    assert penalize(logits, {0, 1}, 1.0) is logits
    assert penalize(logits, set(), 2.0) is logits


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_penalty_breaks_greedy_loops(model_dir: Path) -> None:
    """The tiny model's greedy output repeats itself; a penalty of 1 changes nothing, a strong
    one repeats less, and sampled output with a penalty is fixed by its seed."""
    model = load_model(model_dir).model
    prompt = [5, 6, 7]
    plain = generate(model, prompt, 24)
    assert _repeats(plain) > 0  # the premise: greedy decoding loops here
    assert generate(model, prompt, 24, repetition_penalty=1.0) == plain
    strong = generate(model, prompt, 24, repetition_penalty=1e6)
    assert _repeats(strong) < _repeats(plain)
    sampled = generate(model, prompt, 24, temperature=0.8, seed=3, repetition_penalty=1.3)
    assert sampled == generate(model, prompt, 24, temperature=0.8, seed=3, repetition_penalty=1.3)


def test_cli_flag_and_bad_value(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    base = ["generate", "--model", str(model_dir), "--quantize", "none", "--prompt", "To be"]
    assert main([*base, "--max-tokens", "6", "--repetition-penalty", "1.5", "--seed", "1"]) == 0
    capsys.readouterr()
    assert main([*base, "--repetition-penalty", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "mesp: error: --repetition-penalty must be > 0 (1 = off), got 0.0\n"
