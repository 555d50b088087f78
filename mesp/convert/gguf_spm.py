"""SentencePiece-style tokenizer.json (BPE with byte fallback: Llama 2, Mistral, Gemma) -> the
`tokenizer.ggml.model = "llama"` keys llama.cpp reads: tokens, scores and token types.

llama.cpp's converter takes these from tokenizer.model (`_set_vocab_sentencepiece`); from a
tokenizer.json alone (gguf-py's `LlamaHfVocab`) it writes every score as -1000, which loses the
merge order. SentencePiece's BPE trainer scores each piece -(the order it was learned in), and a
reader of a "llama" vocabulary (llama.cpp, transformers' GGUF loader, mesp's) merges the pair
whose joined token scores highest, so we score a token -(rank of the first merge that makes it):
the tokenizer.json's own merge order. Token types follow `LlamaHfVocab`: "<0xXX>" is BYTE, a
special added token CONTROL, the unknown token UNKNOWN, another added token USER_DEFINED.

Two space conventions are read back by architecture (as transformers and mesp's reader do):
- Llama 2 / Mistral: a "▁" prefix and spaces as "▁" (a Metaspace pre-tokenizer, or the older
  Prepend + Replace normalizer, which the readers' Metaspace "first" matches except on text
  that starts with a space or follows a special token); `add_space_prefix` true;
- Gemma: spaces as "▁", no prefix; whitespace-run tokens are stored as real spaces ("▁▁" ->
  "  ", as Gemma's own GGUF files spell them) and `add_space_prefix` is false.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from gguf import GGUFValueType as VT
from gguf import TokenType

from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer

GEMMA = ("gemma", "gemma2", "gemma3")


class KV(NamedTuple):
    """One GGUF metadata key as GGUFWriter.add_key_value takes it (here, not in gguf_vocab,
    which imports this module)."""

    key: str
    value: Any
    vtype: VT
    sub: VT | None = None


_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _is_replace_space(n: dict[str, Any] | None) -> bool:
    return (
        n is not None
        and n.get("type") == "Replace"
        and n.get("pattern") == {"String": " "}
        and n.get("content") == "▁"
    )


def space_style(spec: dict[str, Any]) -> str | None:
    """ "prefix" (Llama 2), "gemma", or None for a pipeline that is neither."""
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    if norm is None and pre is not None and pre.get("type") == "Metaspace":
        # tokenizers before 0.14 wrote add_prefix_space instead of prepend_scheme
        scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "")
        if pre.get("replacement") == "▁" and scheme in ("first", "always"):
            return "prefix"
    if pre is None and norm is not None and norm.get("type") == "Sequence":
        steps = norm.get("normalizers", [])
        if (
            len(steps) == 2
            and steps[0] == {"type": "Prepend", "prepend": "▁"}
            and _is_replace_space(steps[1])
        ):
            return "prefix"
    split_space = pre is not None and pre.get("type") == "Split"
    split_space = split_space and pre.get("pattern") == {"String": " "}
    split_space = split_space and pre.get("behavior") == "MergedWithPrevious"
    if _is_replace_space(norm) and (pre is None or split_space):
        return "gemma"
    return None


def _merge_ranks(model: dict[str, Any]) -> dict[str, int]:
    """Token -> rank of the first merge that makes it."""
    ranks: dict[str, int] = {}
    for r, m in enumerate(model.get("merges", [])):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        ranks.setdefault(left + right, r)
    return ranks


def sentencepiece_kvs(tok: Tokenizer, n_rows: int, where: str, family: str) -> list[KV]:
    """The "llama"-model keys of a byte-fallback BPE tokenizer.json, one token per embedding row
    (rows without a token become "[PAD{i}]", UNUSED, as the converter pads them)."""
    spec = json.loads(tok.backend.to_str())
    style = space_style(spec)
    gemma = family in GEMMA
    if style is None or (style == "gemma") != gemma:
        want = "Gemma's (spaces as ▁, no prefix)" if gemma else "a ▁ prefix (Metaspace)"
        raise MespError(
            f"{where}: this SentencePiece-style tokenizer.json does not handle spaces the way "
            f"llama.cpp reads a {family} vocabulary ({want}); merge from the model's .gguf file, "
            "or convert the merged directory with llama.cpp's convert_hf_to_gguf.py"
        )
    if tok.vocab_size > n_rows:
        raise MespError(f"{where}: tokenizer has {tok.vocab_size} tokens, model {n_rows} rows")
    model = spec["model"]
    ranks = _merge_ranks(model)
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    unk = model.get("unk_token")
    last = -float(len(ranks) + 1)  # below every merge: tokens no merge makes
    tokens, scores, types = [], [], []
    for i in range(n_rows):
        text = tok.backend.id_to_token(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            scores.append(-1000.0)
            types.append(TokenType.UNUSED)
            continue
        scores.append(-float(ranks[text]) if text in ranks else last)
        respell = gemma and len(text) > 1 and set(text) == {"▁"}
        if _BYTE.fullmatch(text):
            types.append(TokenType.BYTE)
        elif respell:  # Gemma's whitespace runs: user-defined pieces of its tokenizer.model
            types.append(TokenType.USER_DEFINED)
        elif text == unk:
            types.append(TokenType.UNKNOWN)
        elif i in added:
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
        tokens.append(" " * len(text) if respell else text)
    out = [
        KV("tokenizer.ggml.model", "llama", VT.STRING),
        KV("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        KV("tokenizer.ggml.scores", scores, VT.ARRAY, VT.FLOAT32),
        KV("tokenizer.ggml.token_type", [int(t) for t in types], VT.ARRAY, VT.INT32),
    ]
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "unknown": None, "padding": tok.pad_id}
    if unk is not None:
        ids["unknown"] = tok.backend.token_to_id(unk)
    for key, value in ids.items():
        if value is not None:
            out.append(KV(f"tokenizer.ggml.{key}_token_id", value, VT.UINT32))
    out.append(KV("tokenizer.ggml.add_bos_token", bool(tok.add_bos), VT.BOOL))
    out.append(KV("tokenizer.ggml.add_space_prefix", style == "prefix", VT.BOOL))
    if tok.chat_template:
        out.append(KV("tokenizer.chat_template", tok.chat_template, VT.STRING))
    return out
