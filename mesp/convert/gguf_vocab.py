"""The `tokenizer.*` metadata of a GGUF file we write: copied from a GGUF source, or built from
an HF tokenizer.json the way llama.cpp's convert_hf_to_gguf.py builds it (`_set_vocab_gpt2`).

From tokenizer.json we write byte-level BPE vocabularies (SmolLM2, Qwen2/2.5/3, Llama 3 and any
tokenizer.json of that kind), where the pre-tokenizer is one llama.cpp names in
`tokenizer.ggml.pre` and mesp's own GGUF reader rebuilds (`PRE_SPLITS`), and SentencePiece-style
BPE with byte fallback (Llama 2's, Mistral's, Gemma's: gguf_spm.py). Anything else (a Unigram
model, WordPiece, an unknown pre-tokenizer) gets a one-line error: merge from the model's GGUF,
or convert with llama.cpp's own script.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as VT
from gguf import TokenType

from mesp.convert.gguf_spm import KV, sentencepiece_kvs
from mesp.errors import MespError
from mesp.loading import Loaded
from mesp.loading.gguf import read_metadata
from mesp.loading.gguf_tokenizer import PRE_SPLITS
from mesp.loading.tokenizer import Tokenizer


def vocab_kvs(loaded: Loaded, n_rows: int) -> list[KV]:
    """The tokenizer keys for a merged model with `n_rows` embedding rows."""
    if loaded.fmt == "gguf":  # the source's own keys, with their own value types
        meta = read_metadata(Path(loaded.source))
        return [
            KV(k, v, VT(t), None if s is None else VT(s))
            for k, (v, t, s) in meta.items()
            if k.startswith("tokenizer.")
        ]
    if loaded.tokenizer is None:
        raise MespError(
            f"{loaded.source}: no tokenizer (tokenizer.json); llama.cpp needs one in the GGUF"
        )
    spec = json.loads(loaded.tokenizer.backend.to_str())
    model = spec.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        family = loaded.model.config.family
        return sentencepiece_kvs(loaded.tokenizer, n_rows, loaded.source, family)
    return byte_level_kvs(loaded.tokenizer, n_rows, loaded.source)


def _pre_name(pre: dict[str, Any] | None) -> str | None:
    """tokenizer.json's pre_tokenizer -> llama.cpp's `tokenizer.ggml.pre`, for the splits mesp
    reads back identically; None when it is none of them."""
    if pre is None:
        return None
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    last = steps[-1]
    if kinds[-1] != "ByteLevel" or last.get("add_prefix_space"):
        return None
    if kinds == ["ByteLevel"] and last.get("use_regex", True):
        return "gpt-2"  # convert_hf_to_gguf's name; llama.cpp refuses "gpt2" as a pre-tokenizer
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm" if last.get("use_regex", True) else None
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True):
        split = steps[0]
        regex = split.get("pattern", {}).get("Regex")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            return None
        # first name that maps to this regex: llama.cpp's canonical one ("llama-bpe", "qwen2")
        canonical = {"llama-bpe": PRE_SPLITS["llama-bpe"], "qwen2": PRE_SPLITS["qwen2"]}
        return next((name for name, r in canonical.items() if r == regex), None)
    return None


def _looks_special(text: str) -> bool:
    """llama.cpp's `does_token_look_special`: added tokens it marks CONTROL even when the
    tokenizer does not call them special."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def byte_level_kvs(tok: Tokenizer, n_rows: int, where: str) -> list[KV]:
    """llama.cpp's gpt2-model keys from a tokenizers pipeline: one token per embedding row
    (rows without a token become "[PAD{i}]", UNUSED, as the converter pads them)."""
    spec = json.loads(tok.backend.to_str())
    model = spec.get("model", {})
    pre = _pre_name(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or model.get("byte_fallback") or pre is None:
        raise MespError(
            f"{where}: only byte-level BPE tokenizers (SmolLM2, Qwen, Llama 3 style) and "
            "SentencePiece-style BPE with byte fallback (Llama 2, Gemma) can be written to GGUF "
            "from tokenizer.json; merge from the model's .gguf file instead, "
            "or convert the merged directory with llama.cpp's convert_hf_to_gguf.py"
        )
    norm = spec.get("normalizer")
    if norm is not None and not (pre == "qwen2" and norm.get("type") == "NFC"):
        raise MespError(f"{where}: tokenizer.json normalizer {norm.get('type')!r} has no GGUF form")
    if tok.vocab_size > n_rows:
        raise MespError(f"{where}: tokenizer has {tok.vocab_size} tokens, model {n_rows} rows")
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(n_rows):
        text = tok.backend.id_to_token(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tokens.append(text)
        if i not in added:
            types.append(TokenType.NORMAL)
        elif added[i].get("special") or _looks_special(text):
            types.append(TokenType.CONTROL)
        else:
            types.append(TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        # llama.cpp refuses a "gpt2" vocabulary without tokenizer.ggml.merges ("cannot find
        # tokenizer merges in model file"), and GGUF writers store no empty array: refuse here.
        # (convert_hf_to_gguf.py leaves the key out with a warning; the file does not load.)
        raise MespError(
            f"{where}: tokenizer.json has no BPE merges, and llama.cpp cannot load a byte-level "
            "GGUF vocabulary without them; merge to a directory (--out DIR) instead"
        )
    out = [
        KV("tokenizer.ggml.model", "gpt2", VT.STRING),
        KV("tokenizer.ggml.pre", pre, VT.STRING),
        KV("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        KV("tokenizer.ggml.token_type", [int(t) for t in types], VT.ARRAY, VT.INT32),
        KV("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING),
    ]
    for key, value in (("bos", tok.bos_id), ("eos", tok.eos_id), ("padding", tok.pad_id)):
        if value is not None:
            out.append(KV(f"tokenizer.ggml.{key}_token_id", value, VT.UINT32))
    out.append(KV("tokenizer.ggml.add_bos_token", bool(tok.add_bos), VT.BOOL))
    if tok.chat_template:
        out.append(KV("tokenizer.chat_template", tok.chat_template, VT.STRING))
    return out
