"""Pre-tokenized rows need no tokenizer: train, eval and grad on a model directory without
tokenizer files and on random:SHAPE; text without a tokenizer, and generation, are one error."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mesp.cli import main
from mesp.config import ModelConfig
from mesp.data import load_jsonl, pad_id_of
from mesp.errors import MespError
from mesp.loading import zoo
from tests.tiny_dir import VOCAB, make_model_dir, make_tokenizer, train_argv

# A random: shape small enough for the fast suite, put into the zoo's table by the test that
# uses it, so random:SHAPE runs through the same path as the shipped shapes.
TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
COMMON = ["--quantize", "none", "--seq-len", "16"]


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_model_dir(tmp_path_factory.mktemp("m") / "bare", "qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()
    return d


def ids_jsonl(path: Path, vocab: int, n: int = 12, mask: bool = False) -> Path:
    r = random.Random(0)
    rows = []
    for _ in range(n):
        row: dict = {"input_ids": [r.randrange(vocab) for _ in range(14)]}
        if mask:
            row["loss_mask"] = [0] * 7 + [1] * 7
        rows.append(row)
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return path


def train_eval_grad(model: str, data: Path, tmp: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp / "ad"
    argv = train_argv(Path(model), data, out, *COMMON, steps=2, batch_size=2, eval_every=0)
    assert main(argv) == 0
    assert (out / "adapter_model.safetensors").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["valid_ppl_before"] > 1
    capsys.readouterr()
    assert main(["eval", "--model", model, "--adapter", str(out), "--data", str(data),
                 *COMMON, "--json"]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] > 0 and res["ppl"] > 1
    g = tmp / "g.safetensors"
    assert main(["grad", "--model", model, "--adapter", str(out), "--data", str(data),
                 *COMMON, "--out", str(g)]) == 0  # fmt: skip
    grads = load_file(str(g))
    assert grads and any(float(t.abs().sum()) > 0 for t in grads.values())


def test_model_dir_without_tokenizer_files(
    bare_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = ids_jsonl(tmp_path / "train.jsonl", VOCAB, mask=True)
    train_eval_grad(str(bare_dir), data, tmp_path, capsys)


def test_random_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(zoo.SHAPES, "tiny-test", TINY)
    data = ids_jsonl(tmp_path / "train.jsonl", TINY["vocab_size"])
    train_eval_grad("random:tiny-test", data, tmp_path, capsys)


@pytest.mark.slow
def test_random_shipped_shape_evaluates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = ids_jsonl(tmp_path / "p.jsonl", 49152, n=2)
    assert main(["eval", "--model", "random:smollm2-135m", "--data", str(data), *COMMON,
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["tokens"] == 2 * 13


@pytest.mark.parametrize(
    "rows,fragment",
    [
        ([{"text": "To be"}], "this row is text, which needs a tokenizer"),
        ([{"input_ids": [1, 2]}, {"messages": []}], "train.jsonl:2: this row is text"),
        ([{"prompt": "a", "completion": "b"}], "this row is text"),
        ([{"input_ids": [1, VOCAB]}], f"token id {VOCAB} outside the vocabulary (0..{VOCAB - 1})"),
        ([{"inputs": [1]}], "row has no known key"),
    ],
)
def test_rows_a_model_without_tokenizer_cannot_read_are_one_line(
    bare_dir: Path, tmp_path: Path, rows: list[dict], fragment: str
) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = train_argv(bare_dir, data, tmp_path / "ad", *COMMON, python=True, steps=1)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("mesp: error: "), r.stderr
    assert fragment in r.stderr


def test_text_sources_and_generation_need_a_tokenizer(
    bare_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("To be, or not to be\n")
    for data in (["--data", str(txt)], []):  # a .txt file; the built-in Shakespeare set
        assert main(["eval", "--model", str(bare_dir), *data, *COMMON]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is text, which needs a tokenizer" in err, err
    assert main(["generate", "--model", str(bare_dir), "--prompt", "To be", *COMMON[:2]]) == 2
    assert "no tokenizer found" in capsys.readouterr().err


def test_pad_id_without_tokenizer_comes_from_the_model_config() -> None:
    def cfg(**over: object) -> ModelConfig:
        return ModelConfig.from_hf({**TINY, **over}, source="t")

    assert pad_id_of(None, cfg(pad_token_id=7, eos_token_id=9)) == 7
    assert pad_id_of(None, cfg(eos_token_id=9)) == 9
    assert pad_id_of(None, cfg(eos_token_id=[11, 12])) == 11
    assert pad_id_of(None, cfg(pad_token_id=10_000, eos_token_id=5)) == 5  # beyond the vocab
    assert pad_id_of(None, cfg()) == 0
    assert pad_id_of(None) == 0


def test_pretokenized_ids_are_checked_against_the_models_vocabulary(tmp_path: Path) -> None:
    """The embedding has the model's rows, which may outnumber the tokenizer's tokens."""
    from mesp.loading.tokenizer import Tokenizer

    tok = Tokenizer(backend=make_tokenizer())
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"input_ids": [1, VOCAB + 50]}) + "\n")
    with pytest.raises(MespError, match=f"outside the vocabulary \\(0..{VOCAB - 1}\\)"):
        load_jsonl(f, tok, 16)
    [ex] = load_jsonl(f, tok, 16, vocab_size=VOCAB + 64)
    assert ex.ids == [1, VOCAB + 50]
    [bare] = load_jsonl(f, None, 16, vocab_size=VOCAB + 64)
    assert bare == ex
    with pytest.raises(MespError, match=f"outside the vocabulary \\(0..{VOCAB + 9}\\)"):
        load_jsonl(f, None, 16, vocab_size=VOCAB + 10)
