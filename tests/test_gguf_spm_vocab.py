"""`mesp merge … --out FILE.gguf` from a SentencePiece-style tokenizer.json (BPE with byte
fallback): the GGUF's "llama" vocabulary, rebuilt by transformers' GGUF loader (a reader that is
not ours) and by mesp's, encodes as the source tokenizer.json does.

The scores carry the merge order. The constructed tokenizer's merges disagree with its id order
on purpose: scored by id (or all -1000, as gguf-py's LlamaHfVocab does), "abc" would split as
▁ + ab + c instead of the source's ▁a + bc.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mesp.loading import load_model
from mesp.loading.gguf import read_metadata
from mesp.loading.tokenizer import Tokenizer
from tests.test_gguf import TEXTS, write_model
from tests.test_gguf_export import _fails, _merge
from tests.test_merge import _adapter
from tests.tiny_dir import make_model_dir

LLAMA = {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}  # plain rope
ABC_TEXTS = ["abc", "abc abc", " cab bc", "é abc\n", "<s>abc</s>", "ab", "  a  "]


def _llama2_tokenizer(legacy: bool = False) -> HFTokenizer:
    """Llama 2's pipeline: specials, 256 byte tokens, pieces; merges in an order of their own."""
    head = ["<unk>", "<s>", "</s>"]
    pieces = ["▁", "a", "b", "c", "ab", "bc", "▁a", "▁ab"]
    tokens = head + [f"<0x{b:02X}>" for b in range(256)] + pieces
    merges = [("b", "c"), ("▁", "a"), ("a", "b"), ("▁a", "b")]
    tok = HFTokenizer(
        models.BPE(
            {t: i for i, t in enumerate(tokens)},
            merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    if legacy:  # Llama 2's first tokenizer.json: the prefix and the spaces by the normalizer
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in head])
    return tok


def _base(tmp: Path, family: str, tok: HFTokenizer, bos: str, eos: str) -> Path:
    base = make_model_dir(tmp / "base", family, **(LLAMA if family == "llama" else {}))
    tok.save(str(base / "tokenizer.json"))
    conf = {"bos_token": bos, "eos_token": eos, "add_bos_token": True}
    (base / "tokenizer_config.json").write_text(json.dumps(conf))
    _adapter(base, tmp / "ad")
    return base


def _same_encodings(base: Path, out: Path, texts: list[str]) -> None:
    import transformers

    src, back = Tokenizer.from_dir(base), load_model(out).tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    assert back is not None
    for text in texts:
        want = src.encode(text, add_bos=False)
        assert back.encode(text, add_bos=False) == want, text
        assert hf(text, add_special_tokens=False).input_ids == want, text
    assert back.encode("abc")[0] == src.bos_id == hf("abc").input_ids[0]  # BOS as configured
    assert (back.bos_id, back.eos_id) == (src.bos_id, src.eos_id)


@pytest.mark.parametrize("legacy", [False, True])
def test_llama2_style_tokenizer_json_round_trips_with_its_merge_order(
    legacy: bool, tmp_path: Path
) -> None:
    src = _llama2_tokenizer(legacy)
    assert [src.id_to_token(i) for i in src.encode("abc").ids] == ["▁a", "bc"]
    base = _base(tmp_path, "llama", src, "<s>", "</s>")
    out = _merge(base, tmp_path, "m.gguf")
    meta = read_metadata(out)
    assert meta["tokenizer.ggml.model"][0] == "llama"
    tokens, types = meta["tokenizer.ggml.tokens"][0], meta["tokenizer.ggml.token_type"][0]
    assert types[:4] == [2, 3, 3, 6] and tokens[3] == "<0x00>"  # unknown, control, byte
    assert meta["tokenizer.ggml.unknown_token_id"][0] == 0
    assert meta["tokenizer.ggml.add_space_prefix"][0] is True
    # the readers rebuild Metaspace "first"; the legacy normalizer differs from it on text that
    # starts with a space ("▁▁cab", not "▁cab") and after a special token (prefixed again)
    texts = ABC_TEXTS + TEXTS
    if legacy:
        texts = [t for t in texts if "<" not in t and not t[:1].isspace()]
    _same_encodings(base, out, texts)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sentencepiece_tokenizer_json_gives_the_gguf_it_came_from(
    family: str, tmp_path: Path
) -> None:
    """A tokenizer.json rebuilt from a SentencePiece GGUF (Llama 2's or Gemma's conventions)
    goes back to the same tokens and types, and encodes alike in both readers."""
    spm = tmp_path / "spm.gguf"
    write_model(spm, family)
    src = load_model(spm).tokenizer
    assert src is not None
    base = _base(tmp_path, family, src.backend, "<bos>", "<eos>")
    out = _merge(base, tmp_path, "m.gguf")
    before, after = read_metadata(spm), read_metadata(out)
    n = len(before["tokenizer.ggml.tokens"][0])  # the model has more rows: [PAD] tokens
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        assert after[key][0][:n] == before[key][0], key  # Gemma's "  " spelled as its files do
    assert after["tokenizer.ggml.tokens"][0][n:] == [f"[PAD{i}]" for i in range(n, 300)]
    _same_encodings(base, out, TEXTS)


def test_unigram_tokenizer_json_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tok = HFTokenizer(models.Unigram([("<unk>", 0.0), ("▁", -1.0), ("a", -2.0)], 0, False))
    tok.normalizer = normalizers.Replace(" ", "▁")
    base = _base(tmp_path, "llama", tok, "<unk>", "<unk>")
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad")]
    _fails([*argv, "--out", str(tmp_path / "m.gguf")], capsys, "SentencePiece-style BPE")
    assert not (tmp_path / "m.gguf").exists()
