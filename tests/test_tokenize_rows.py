"""`mesp tokenize`: the data `mesp train` reads, written as the pre-tokenized rows the on-device
drivers take; and source code (.py, .md) read as text like .txt, a directory's subfolders too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesp.cli import main
from mesp.data.config import DataConfig
from mesp.data.files import load_splits, text_files
from mesp.data.tokenize import TokenizeOptions, tokenizer_of, write_rows
from mesp.errors import MespError
from mesp.loading.session import ModelOptions
from tests.tiny_dir import TEXT, make_jsonl, make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_rows_equal_what_train_reads(model_dir: Path, tmp_path: Path) -> None:
    """Every split's examples, in order, as {"input_ids", "loss_mask"}: the prompt-completion
    rows' masks keep --mask-prompt's choice, and --split picks train or valid."""
    data = make_jsonl(tmp_path / "pc.jsonl", 40)
    cfg = DataConfig(path=str(data), seq_len=32, mask_prompt=True)
    opts = ModelOptions(model=str(model_dir))
    splits = load_splits(cfg, tokenizer_of(opts))
    for split, want in (
        ("all", splits["train"] + splits["valid"]),
        ("train", splits["train"]),
        ("valid", splits["valid"]),
    ):
        out = tmp_path / f"{split}.jsonl"
        line = write_rows(opts, TokenizeOptions(out=str(out), split=split), cfg)
        got = _rows(out)
        assert [r["input_ids"] for r in got] == [ex.ids for ex in want]
        assert [r["loss_mask"] for r in got] == [ex.mask for ex in want]
        assert f"wrote {len(want)} rows" in line
    assert any(0 in r["loss_mask"][1:] for r in _rows(tmp_path / "all.jsonl"))  # prompts masked


def test_source_tree_as_text_and_the_cli(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A package directory: its .py and .md files, subfolders included, in path order; other
    files ignored. Packed into full rows, every token after the first trained; then the rows
    evaluate through `mesp eval` as pre-tokenized data with the loss of the text itself."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("\n".join(TEXT[:5]))
    (pkg / "sub" / "b.py").write_text("\n".join(TEXT[5:10]))
    (pkg / "README.md").write_text(TEXT[3])
    (pkg / "data.bin").write_bytes(b"\x00\x01")
    assert [p.relative_to(pkg).as_posix() for p in text_files(pkg)] == [
        "README.md",
        "a.py",
        "sub/b.py",
    ]
    out = tmp_path / "rows.jsonl"
    argv = ["tokenize", "--model", str(model_dir), "--data", str(pkg), "--seq-len", "16"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "mesp: wrote" in capsys.readouterr().out
    rows = _rows(out)
    assert rows and all(len(r["input_ids"]) <= 17 for r in rows)
    # every token trained but each file's first (two such starts fall inside the packed rows)
    assert sum(r["loss_mask"][1:].count(0) for r in rows) <= 2

    def loss(data: Path) -> float:  # a file: all of it; a directory: its valid split
        assert main(["eval", "--model", str(model_dir), "--data", str(data), "--json",
                     "--seq-len", "16"]) == 0  # fmt: skip
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]

    valid = tmp_path / "valid.jsonl"
    assert main([*argv, "--out", str(valid), "--split", "valid"]) == 0
    capsys.readouterr()
    assert loss(valid) == pytest.approx(loss(pkg), rel=1e-6)


def test_bad_input_is_one_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = make_jsonl(tmp_path / "pc.jsonl", 8)
    for argv, needle in [
        (["--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "x.txt")],
         "rows are written as a .jsonl file"),
        (["--model", str(model_dir), "--data", str(data), "--out",
          str(tmp_path / "no" / "r.jsonl")], "no such directory"),
        (["--model", "random:tiny-llama", "--data", str(data), "--out", str(tmp_path / "r.jsonl")],
         "random weights have no tokenizer"),
        (["--model", str(model_dir), "--data", str(tmp_path / "none"), "--out",
          str(tmp_path / "r.jsonl")], "no such file or directory"),
    ]:  # fmt: skip
        assert main(["tokenize", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err
    assert not (tmp_path / "r.jsonl").exists()
    with pytest.raises(MespError, match="no tokenizer found"):
        tokenizer_of(ModelOptions(model=str(tmp_path)))
