"""`mesp tokenize`: any data `mesp train` reads, as pre-tokenized rows for the on-device drivers.

The native runner and `mesp run-artifacts` take jsonl rows `{"input_ids": [...], "loss_mask":
[...]}` and no tokenizer. This writes them from the same data path `mesp train` uses (jsonl of
text / prompt-completion / messages, plain text, source code), with the model's own tokenizer,
read alone: a GGUF file's metadata or a directory's tokenizer.json, no weights loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mesp.atomic_io import atomic_write
from mesp.data.config import DataConfig
from mesp.data.files import load_splits
from mesp.errors import MespError
from mesp.loading.session import ModelOptions
from mesp.loading.tokenizer import Tokenizer

SPLITS = ("all", "train", "valid")


@dataclass
class TokenizeOptions:
    out: str = field(
        default="", metadata={"help": "the rows file to write (FILE.jsonl)", "required": True}
    )
    split: str = field(
        default="all",
        metadata={
            "help": "which rows: all (train then valid), train, or valid (--valid-fraction of "
            "a file or directory without a valid.jsonl)",
            "choices": SPLITS,
        },
    )


def tokenizer_of(opts: ModelOptions) -> Tokenizer:
    """The model's tokenizer without its weights."""
    from mesp.loading.zoo import resolve

    if opts.model.startswith("random:"):
        raise MespError(f"{opts.model}: random weights have no tokenizer; give a real model")
    path = Path(resolve(opts.model) or opts.model)
    if path.is_file() and path.suffix == ".gguf":
        from mesp.loading.gguf import GGUFFile

        with GGUFFile(path) as g:
            return g.tokenizer
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_dir(path)
    raise MespError(f"{opts.model}: no tokenizer found (a .gguf file or a dir with tokenizer.json)")


def write_rows(opts: ModelOptions, t: TokenizeOptions, data: DataConfig) -> str:
    """Write the rows of `data` (split `t.split`) to `t.out`; return the line saying so."""
    out = Path(t.out)
    if out.suffix != ".jsonl":
        raise MespError(f"--out {out}: rows are written as a .jsonl file")
    if t.split not in SPLITS:
        raise MespError(f"--split {t.split!r}: choose from {', '.join(SPLITS)}")
    if not out.parent.is_dir():
        raise MespError(f"{out.parent}: no such directory")
    tok = tokenizer_of(opts)
    splits = load_splits(data, tok)
    names = ("train", "valid") if t.split == "all" else (t.split,)
    rows = [ex for name in names for ex in splits.get(name, [])]
    if not rows:
        raise MespError(f"{data.path}: no {t.split} rows")

    def write(path: str) -> None:
        with open(path, "w") as f:
            for ex in rows:
                f.write(json.dumps({"input_ids": ex.ids, "loss_mask": ex.mask}) + "\n")

    atomic_write(out, write)
    tokens = sum(len(ex.ids) for ex in rows)
    trained = sum(ex.n_targets for ex in rows)
    return (
        f"mesp: wrote {len(rows)} rows ({tokens} tokens, {trained} trained) of "
        f"{data.path or 'the built-in Shakespeare set'} ({t.split}) to {out}"
    )
