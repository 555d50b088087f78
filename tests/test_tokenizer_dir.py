"""Tokenizer.from_dir: specials from tokenizer_config.json, BOS from the post-processor when
the config does not say (Llama 3), and a clear error for a broken config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import processors

from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer
from tests.tiny_dir import make_tokenizer


def _dir(tmp_path: Path, config: dict | str, bos_post_processor: bool) -> Path:
    tok = make_tokenizer()
    bos = tok.token_to_id("<|system|>")  # any special token can play BOS here
    if bos_post_processor:  # what Llama 3's tokenizer.json does (no add_bos_token anywhere)
        tok.post_processor = processors.TemplateProcessing(
            single="<|system|> $A", special_tokens=[("<|system|>", bos)]
        )
    tok.save(str(tmp_path / "tokenizer.json"))
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "tokenizer_config.json").write_text(text)
    return tmp_path


def test_bos_from_the_post_processor(tmp_path: Path) -> None:
    d = _dir(tmp_path, {"bos_token": "<|system|>", "eos_token": "<eos>"}, True)
    tok = Tokenizer.from_dir(d)
    assert tok.add_bos and tok.bos_id == tok.backend.token_to_id("<|system|>")
    assert tok.encode("To be")[0] == tok.bos_id
    assert tok.encode("To be")[1:] == tok.backend.encode("To be", add_special_tokens=False).ids


def test_no_bos_without_post_processor_or_config(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_dir(tmp_path, {"eos_token": "<eos>"}, False))
    assert not tok.add_bos


def test_config_key_wins_over_the_post_processor(tmp_path: Path) -> None:
    d = _dir(tmp_path, {"bos_token": "<|system|>", "add_bos_token": False}, True)
    assert not Tokenizer.from_dir(d).add_bos


@pytest.mark.parametrize("text", ["{nope", "[1]", "\xff"])
def test_broken_tokenizer_config_is_one_line(tmp_path: Path, text: str) -> None:
    d = _dir(tmp_path, text, False)
    with pytest.raises(MespError, match="tokenizer_config.json") as e:
        Tokenizer.from_dir(d)
    assert "\n" not in str(e.value)
