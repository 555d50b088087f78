"""Build a `mesp.loading.tokenizer.Tokenizer` from the tokenizer a GGUF file describes.

A GGUF has no tokenizer.json: it stores tokens, merges (or SentencePiece scores), token types and
special ids under `tokenizer.ggml.*`. We rebuild the `tokenizers` pipeline the original HF tokenizer
used; transformers does the same (integrations/gguf/gguf_tokenizer_mapping.py), and our ids are
tested against it. `tokenizer.ggml.model` picks the family:
  "gpt2"  -> byte-level BPE from the file's merges, split the way `tokenizer.ggml.pre` says;
  "llama" -> SentencePiece-style BPE with byte fallback, merges recovered from the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types (tokenizer.ggml.token_type)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> regex split before byte-level BPE. None = GPT-2's regex (ByteLevel's own);
# "digits" = GPT-2's regex after isolating every digit, as SmolLM2's tokenizer.json does.
PRE_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "gpt2": None,  # what mesp wrote before it wrote llama.cpp's "gpt-2"
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"], _LLAMA3_SPLIT
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# Token texts llama.cpp treats as end-of-generation when they are control tokens.
_STOP_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table that byte-level vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _merges_from_vocab(
    vocab: dict[str, int],
    priority: Mapping[str, float],
) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a token into two tokens is a merge,
    ranked by the whole token's priority (ties: longer left piece first), as transformers'
    `generate_merges` does."""
    merges: list[tuple[str, str, float]] = []
    for token, score in priority.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level(meta: Mapping[str, Any], tokens: list[str], where: str) -> HFTokenizer:
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    # Every real byte-level token is already spelled in the alphabet; respell any stray one.
    vocab = {
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    if "tokenizer.ggml.merges" not in meta:
        raise MespError(f"{where}: missing metadata key 'tokenizer.ggml.merges'")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bad = next((i for i, m in enumerate(merges) if len(m) != 2), None)
    if bad is not None:
        raise MespError(f"{where}: tokenizer.ggml.merges[{bad}] is not two tokens and a space")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise MespError(
            f"{where}: tokenizer.ggml.pre = {pre!r} is not supported "
            f"({', '.join(sorted(PRE_SPLITS))})"
        )
    split = PRE_SPLITS[pre]
    tok = HFTokenizer(
        BPE(
            vocab,
            merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=split == _LLAMA3_SPLIT,
        )
    )  # llama.cpp does for llama3
    if split is None or split == "digits":
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = (
            byte_level
            if split is None
            else pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if split == _QWEN2_SPLIT:
        tok.normalizer = normalizers.NFC()  # Qwen's own tokenizer.json normalizes to NFC
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], unk: str | None) -> HFTokenizer:
    gemma = meta.get("general.architecture") in ("gemma", "gemma2", "gemma3")
    if gemma:
        # Gemma files store whitespace-run tokens as real spaces where the model spells them "▁",
        # and its scores do not follow merge order -- file order does (as in transformers).
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority: Mapping[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        priority = dict(zip(tokens, scores, strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(
        BPE(
            vocab,
            _merges_from_vocab(vocab, priority),
            fuse_unk=True,
            byte_fallback=True,
            unk_token=unk,
            dropout=None,
        )
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # Gemma has no dummy prefix: spaces simply become "▁"
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
        steps += [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence(steps)
    return tok


def _special_id(meta: Mapping[str, Any], key: str, n: int, where: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n:
        raise MespError(
            f"{where}: tokenizer.ggml.{key} = {value!r} is outside the vocabulary (size {n})"
        )
    return value


def tokenizer_from_gguf(meta: Mapping[str, Any], where: str) -> Tokenizer:
    """Tokenizer from parsed GGUF metadata (`key -> value`); `where` names the file in errors."""
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if key not in meta:
            raise MespError(f"{where}: missing metadata key '{key}'")
    model, tokens = meta["tokenizer.ggml.model"], list(meta["tokenizer.ggml.tokens"])
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise MespError(f"{where}: {len(types)} token types for {len(tokens)} tokens")
    typed = list(zip(tokens, types, strict=True))
    ids = {
        k: _special_id(meta, f"{k}_token_id", len(tokens), where)
        for k in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    try:
        return _build(meta, model, tokens, typed, ids, where)
    except Exception as e:  # `tokenizers` raises bare Exceptions on bad vocab/merges
        if isinstance(e, MespError):
            raise
        why = " ".join(str(e).split())  # its messages span lines; ours are one
        raise MespError(f"{where}: cannot build the tokenizer: {why}") from None


def _build(
    meta: Mapping[str, Any],
    model: str,
    tokens: list[str],
    typed: list[tuple[str, int]],
    ids: dict[str, int | None],
    where: str,
) -> Tokenizer:
    if model == "gpt2":
        backend = _byte_level(meta, tokens, where)
        spelled = set(_bytes_to_unicode().values())
        # A control token outside the byte alphabet is a llama.cpp mislabel (transformers agrees).
        control = [t for t, ty in typed if ty == CONTROL and set(t) <= spelled]
        default_bos = False
    elif model == "llama":
        unk = tokens[ids["unknown"]] if ids["unknown"] is not None else None
        backend = _sentencepiece(meta, tokens, unk)
        control = [t for t, ty in typed if ty == CONTROL]
        default_bos = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise MespError(f"{where}: tokenizer.ggml.model = {model!r} is not supported (gpt2, llama)")
    # Control tokens must match whole, not be cut into pieces; user-defined ones (e.g. "<think>")
    # are matched whole too but decoded like text.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = backend.get_vocab()
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, ty in typed
            if ty == USER_DEFINED and t in vocab
        ]
    )
    extra = [ids["eot"], ids["eom"]] + [
        i for i, (t, ty) in enumerate(typed) if ty == CONTROL and t in _STOP_TEXTS
    ]
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(
        backend=backend,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["padding"],
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
        chat_template=template if isinstance(template, str) else None,
        extra_eos_ids=sorted({i for i in extra if i is not None and i != ids["eos"]}),
    )
