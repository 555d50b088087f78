"""Preference pairs (DPO, ORPO): rows -> `Pair`s -> batches of (chosen, rejected) rows.

Row formats (one JSON object per line), TRL's:
  {"prompt": str, "chosen": str, "rejected": str}   standard: the strings as they are, the
        prompt tokenized as a sequence start (BOS if the model adds one), each completion
        followed by EOS
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   conversational: the
        chat template renders prompt (with the generation prompt) and prompt + completion; the
        completion is what the template writes after the prompt
  {"prompt_input_ids": [...], "chosen_input_ids": [...], "rejected_input_ids": [...]}
        pre-tokenized (no tokenizer needed), used as they are
Only completion tokens are trained (and scored). A sequence over seq_len+1 tokens is, with
--overlong truncate, cut as TRL does: the prompt first (its start dropped, keeping at least one
token), then the completion's end; with error, refused; with drop, the pair is skipped.
A batch of k pairs is 2k rows: row 2i pair i's chosen sequence, row 2i+1 its rejected one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesp.batch import Batch, Example, collate
from mesp.data.batches import BatchStream
from mesp.data.config import DataConfig
from mesp.data.files import _jsonl_rows, split_off_valid
from mesp.data.rows import NO_TOKENIZER, _json_type, _string, one_line
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer

KEYS = ("prompt", "chosen", "rejected")
IDS = tuple(f"{k}_input_ids" for k in KEYS)
FORMATS = (
    'preference rows: {"prompt", "chosen", "rejected"} (strings, or lists of messages) or '
    '{"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}'
)
_log = logging.getLogger(__name__)


@dataclass
class Pair:
    """A prompt with a chosen and a rejected completion, as two training sequences."""

    chosen: Example
    rejected: Example

    @property
    def ids(self) -> list[int]:  # split_off_valid hashes a pair by both sequences
        return self.chosen.ids + self.rejected.ids

    @property
    def mask(self) -> list[int]:
        return self.chosen.mask + self.rejected.mask


def _ids(row: dict[str, Any], key: str, vocab: int, where: str) -> list[int]:
    v = row[key]
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise MespError(f'{where}: "{key}" must be an array of integers')
    bad = next((x for x in v if not 0 <= x < vocab), None)
    if bad is not None:
        raise MespError(
            f"{where}: {key} has token id {bad} outside the vocabulary (0..{vocab - 1})"
        )
    return v


def _messages(v: Any, key: str, where: str) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise MespError(f'{where}: "{key}" must be a non-empty array of {{role, content}}')
    for j, m in enumerate(v):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise MespError(f'{where}: {key}[{j}] must be an object with "role", "content"')
        _string(m, "role", f"{where}: {key}[{j}]")
        _string(m, "content", f"{where}: {key}[{j}]")
    return v


def _conversational(row: dict[str, Any], tok: Tokenizer, where: str) -> list[list[int]]:
    prompt = _messages(row["prompt"], "prompt", where)

    def render(ms: list[dict[str, Any]], gen: bool) -> str:
        try:
            return tok.apply_chat_template(ms, add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 -- template code comes with the model
            raise MespError(f"{where}: chat template failed on this row: {one_line(e)}") from None

    head = render(prompt, True)
    eos = [tok.eos_id] if not tok.chat_template and tok.eos_id is not None else []
    out = [tok.encode(head)]
    for key in KEYS[1:]:
        full = render(prompt + _messages(row[key], key, where), False)
        if not full.startswith(head):
            raise MespError(
                f"{where}: the chat template renders the prompt differently before {key}"
            )
        out.append(tok.encode(full[len(head) :], add_bos=False) + eos)
    return out


def parse_pair(row: Any, tok: Tokenizer | None, vocab: int | None, where: str) -> list[list[int]]:
    """[prompt ids, chosen ids, rejected ids] of one decoded row."""
    if not isinstance(row, dict):
        raise MespError(f"{where}: row is a JSON {_json_type(row)}, not an object; {FORMATS}")
    if all(k in row for k in IDS):
        if vocab is None:
            vocab = tok.vocab_size if tok is not None else None
        assert vocab is not None, "parse_pair needs a tokenizer or the model's vocab_size"
        return [_ids(row, k, vocab, where) for k in IDS]
    if not all(k in row for k in KEYS):
        keys = ", ".join(repr(k[:40]) for k in list(row)[:6]) or "none"
        raise MespError(f"{where}: not a preference row (keys: {keys}); {FORMATS}")
    if tok is None:
        raise MespError(f"{where}: this row {NO_TOKENIZER}")
    if isinstance(row["prompt"], list):
        return _conversational(row, tok, where)
    prompt, chosen, rejected = (_string(row, k, where) for k in KEYS)
    eos = [tok.eos_id] if tok.eos_id is not None else []
    return [tok.encode(prompt)] + [tok.encode(c, add_bos=False) + eos for c in (chosen, rejected)]


def fit(prompt: list[int], completions: list[list[int]], cap: int) -> list[list[int]]:
    """TRL's truncation: the prompt loses its start first (one token stays), then each
    completion its end, until prompt + the longer completion holds `cap` tokens."""
    longest = max(len(c) for c in completions)
    if len(prompt) + longest > cap:
        keep = max(1, cap - longest)
        prompt = prompt[-keep:] if prompt else prompt
    return [prompt] + [c[: cap - len(prompt)] for c in completions]


def to_pair(parts: list[list[int]], where: str) -> Pair:
    prompt, chosen, rejected = parts
    if not chosen or not rejected:
        raise MespError(f"{where}: an empty chosen or rejected completion")
    ex = [Example(prompt + c, [0] * len(prompt) + [1] * len(c)) for c in (chosen, rejected)]
    if not prompt:  # the first token predicts nothing: it cannot be scored
        ex = [Example(e.ids, [0] + e.mask[1:]) for e in ex]
    if ex[0].n_targets == 0 or ex[1].n_targets == 0:
        raise MespError(f"{where}: a completion has no token after the prompt to score")
    return Pair(ex[0], ex[1])


def load_pairs(
    path: Path,
    tok: Tokenizer | None,
    seq_len: int,
    overlong: str = "truncate",
    vocab: int | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[Pair]:
    """One jsonl file of preference rows; each sequence at most seq_len+1 tokens."""
    warn, cap = warn or _log.warning, seq_len + 1
    out: list[Pair] = []
    cut = dropped = rows = 0
    for where, obj in _jsonl_rows(path):
        rows += 1
        parts = parse_pair(obj, tok, vocab, where)
        if len(parts[0]) + max(len(parts[1]), len(parts[2])) > cap:
            if overlong == "error":
                raise MespError(
                    f"{where}: a sequence is longer than --seq-len {seq_len}+1 tokens; raise "
                    "--seq-len or use --overlong truncate"
                )
            if overlong == "drop":
                dropped += 1
                continue
            cut += 1
            parts = fit(parts[0], parts[1:], cap)
        out.append(to_pair(parts, where))
    if rows == 0:
        raise MespError(f"{path}: no rows (the file is empty)")
    if cut or dropped:
        what = "truncated (prompt first)" if cut else "dropped"
        warn(f"{path}: {what} {cut or dropped} of {rows} pairs longer than {cap} tokens")
    if not out:
        raise MespError(f"{path}: no usable pairs")
    return out


def load_pair_splits(
    cfg: DataConfig, tok: Tokenizer | None, vocab: int | None = None
) -> dict[str, list[Pair]]:
    """ "train" and "valid" pairs: DIR/train.jsonl [+ valid.jsonl], or one .jsonl file with a
    held-out share (`cfg.valid_fraction`, chosen by content as SFT's split)."""
    cfg.validate()
    if cfg.path is None:
        raise MespError("a preference objective needs --data (preference rows; " + FORMATS + ")")
    if cfg.pack:
        raise MespError("--pack does not apply to preference pairs (each pair is two rows)")
    p = Path(cfg.path).expanduser()

    def read(f: Path) -> list[Pair]:
        return load_pairs(f, tok, cfg.seq_len, cfg.overlong, vocab)

    if p.is_dir() and (p / "train.jsonl").is_file():
        train = read(p / "train.jsonl")
        if (p / "valid.jsonl").is_file():
            splits = {"train": train, "valid": read(p / "valid.jsonl")}
        else:
            t, v = split_off_valid(train, cfg.valid_fraction, str(p / "train.jsonl"))  # type: ignore[arg-type]
            splits = {"train": t, "valid": v}
    elif p.is_file() and p.suffix == ".jsonl":
        t, v = split_off_valid(read(p), cfg.valid_fraction, str(p))  # type: ignore[arg-type]
        splits = {"train": t, "valid": v}
    else:
        raise MespError(
            f"{p}: a preference objective reads a .jsonl file or a dir with train.jsonl"
        )
    if cfg.max_examples is not None:
        splits = {k: v[: cfg.max_examples] for k, v in splits.items()}
    return splits  # type: ignore[return-value]


def collate_pairs(pairs: Sequence[Pair], pad_id: int = 0) -> Batch:
    return collate([e for p in pairs for e in (p.chosen, p.rejected)], pad_id)


class PairStream(BatchStream):
    """BatchStream over pairs: `batch_size` pairs (2·batch_size rows) per batch."""

    def _collate(self, picked: list[Any]) -> Batch:
        return collate_pairs(picked, self.pad_id)


def iter_pair_batches(pairs: Sequence[Pair], batch_size: int, pad_id: int = 0) -> Iterator[Batch]:
    """Batches of `batch_size` pairs in the given order, once through (validation)."""
    for i in range(0, len(pairs), batch_size):
        yield collate_pairs(pairs[i : i + batch_size], pad_id)
