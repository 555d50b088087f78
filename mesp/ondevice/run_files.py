"""The files a run of the Python driver reads and writes: the training rows in, the adapter out
(PEFT's safetensors + config, and llama.cpp's adapter.gguf where the export recorded one), each
written atomically; and the one error a bad file, row or flag raises. The native runner
(runtime/src/data.cpp, adapter.cpp) reads and writes the same bytes.

Rows: jsonl {"input_ids": [...], "loss_mask": [...]}; loss_mask[i] = 1 trains token i
(predicted from the tokens before it); rows of at most seq_len + 1 tokens, right-padded.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import save_file

from mesp.ondevice.adapter_gguf import adapter_gguf_writer
from mesp.ondevice.contract import ADAPTER_GGUF

PEFT_PREFIX = "base_model.model."


class RunnerError(Exception):
    """Bad artifacts, data or flags: printed as one line, exit code 2."""


def read_rows(path: Path, seq_len: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per jsonl row; mask[i] = 1 trains token i, mask[0] is never trained."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RunnerError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunnerError(f"{where}: not JSON ({e.msg})") from None
        except (ValueError, RecursionError):  # a 5000-digit number, nesting past the stack
            raise RunnerError(
                f"{where}: not JSON (a number too long or nesting too deep)"
            ) from None
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not all(type(x) is int and 0 <= x < vocab for x in ids):
            raise RunnerError(f'{where}: "input_ids" must be a list of token ids in 0..{vocab - 1}')
        if not 2 <= len(ids) <= seq_len + 1:
            raise RunnerError(
                f"{where}: {len(ids)} tokens; rows must have 2..{seq_len + 1} (the exported "
                f"sequence length {seq_len}, plus one)"
            )
        mask = row.get("loss_mask", [1] * len(ids))
        if (
            not isinstance(mask, list)
            or len(mask) != len(ids)
            or any(x not in (0, 1) for x in mask)
        ):
            raise RunnerError(f'{where}: "loss_mask" must be a list of 0/1, one per token')
        rows.append((ids, [0, *(int(x) for x in mask[1:])]))
    if not rows:
        raise RunnerError(f"{path}: no rows")
    return rows


def write_atomic(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp)` into a temp file beside `path`, fsync, rename over `path`, fsync the
    directory: the adapter files and the kernel library (mesp.ondevice.kernels). The driver's
    twin of mesp.atomic_io.atomic_write, which it cannot import (it loads no core modules).
    safetensors' writer raises SafetensorError (not OSError) when the disk is full: it becomes
    an OSError here."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        try:
            write(tmp)
        except SafetensorError as e:
            raise OSError(str(e).splitlines()[0]) from None
        mask = os.umask(0)  # mkstemp's 0600 would hide the adapter from other users: a plain
        os.umask(mask)  # open()'s mode instead
        os.chmod(tmp, 0o666 & ~mask)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_adapter(trainer: Any, out: Path) -> str:
    """PEFT format: adapter_model.safetensors first, adapter_config.json last; between them
    adapter.gguf, llama.cpp's form of it, where the export recorded one. `trainer`: its `art`
    (the Artifacts) and `lora` (one dict of adapter tensors per block). Returns "" or the line
    that says why there is no adapter.gguf."""
    conf = trainer.art.conf
    try:
        write_gguf, note = adapter_gguf_writer(conf, trainer.lora, out)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise RunnerError(
            f"run_config.json: malformed gguf_adapter ({type(e).__name__}: {e})"
        ) from None
    tensors = {
        f"{PEFT_PREFIX}model.layers.{i}.{k}.weight": p.detach().contiguous()
        for i, d in enumerate(trainer.lora)
        for k, p in d.items()
    }
    lora = conf["lora"]
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": lora["targets"],
        "base_model_name_or_path": conf["model"]["base_model"],
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "adapter_model.safetensors", lambda p: save_file(tensors, p))
        if write_gguf is not None:
            write_atomic(out / ADAPTER_GGUF, write_gguf)
        write_atomic(
            out / "adapter_config.json", lambda p: Path(p).write_text(json.dumps(peft, indent=2))
        )
    except OSError as e:
        raise RunnerError(f"{out}: could not save the adapter ({e.strerror or e})") from None
    return note
