"""Defects found trying mesp as a new user would (issue 31): each ended in a traceback, did
the wrong thing silently, or left something behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.test_gguf_export import _base, _fails


def test_merge_to_gguf_without_bpe_merges_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A byte-level BPE tokenizer.json with no merges: llama.cpp cannot load such a GGUF (it
    requires tokenizer.ggml.merges) and gguf's writer cannot store an empty list, so the merge
    refuses in one line (it ended in gguf's 'Empty array' traceback) and writes no file."""
    base = _base(tmp_path, "qwen2")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(sorted(alphabet) + ["<|end|>", "<eos>"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(base / "tokenizer.json"))
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad")]
    _fails([*argv, "--out", str(tmp_path / "m.gguf")], capsys, "no BPE merges", "--out DIR")
    assert not (tmp_path / "m.gguf").exists()
