"""`--keep-best` and `--early-stop`: the best validation loss so far, the adapter that had it,
and how many validations since did not beat it.

The counters live in the training state (`TrainState.best_loss`, `best_step`, `since_best`),
so a resumed run stops at the step an uninterrupted one stops at. `best/` is written when a
validation beats the best so far, before that step's checkpoint: a checkpoint never records a
best step whose adapter is not complete on disk, and a resume replays (and rewrites
identically) any newer best a killed run wrote after its last checkpoint.

`best/` is a plain PEFT adapter directory plus `best.json` (its step and validation loss).
`best.json` is removed first and written last, so a `best/` with a `best.json` always holds
that step's adapter (each file is written atomically; a `best/` without one was being written).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from mesp.atomic_io import atomic_write
from mesp.errors import MespError
from mesp.training.checkpoint import TrainState
from mesp.training.config import TrainConfig

BEST_DIR = "best"
BEST_JSON = "best.json"
_OURS = {BEST_JSON, "adapter_model.safetensors", "adapter_config.json"}


def check_setup(cfg: TrainConfig, has_valid: bool) -> None:
    """Both flags judge validation losses: refuse them, before any step, without any."""
    if has_valid:
        return
    for on, flag in ((cfg.keep_best, "--keep-best"), (cfg.early_stop, "--early-stop")):
        if on:
            raise MespError(
                f"{flag} needs a validation set; this run has none (--valid-fraction 0 and no "
                "valid.jsonl)"
            )


def clear_stale(out_dir: Path) -> None:
    """A fresh run into an old run's directory: that run's best/ is not this run's best (the
    way log.jsonl starts anew). Only a directory holding nothing but what we write is removed."""
    d = out_dir / BEST_DIR
    if d.is_dir() and all(f.name in _OURS or f.name.startswith(".") for f in d.iterdir()):
        shutil.rmtree(d)


def record(st: TrainState, step: int, loss: float) -> bool:
    """Count one validation; True when it beats every earlier one (strictly: a tie keeps the
    earlier step; a NaN never wins)."""
    if st.best_loss is None or loss < st.best_loss:
        st.best_loss, st.best_step, st.since_best = loss, step, 0
        return True
    st.since_best += 1
    return False


def stopped(st: TrainState, cfg: TrainConfig) -> bool:
    """--early-stop N: N validations in a row did not beat the best."""
    return cfg.early_stop > 0 and st.since_best >= cfg.early_stop


def save_best(
    out_dir: Path, step: int, valid: dict[str, float], write_adapter: Callable[[Path], object]
) -> Path:
    """The current adapter as the best one: `write_adapter(dir)` writes the PEFT files."""
    d = out_dir / BEST_DIR
    d.mkdir(exist_ok=True)
    (d / BEST_JSON).unlink(missing_ok=True)  # until the new one is written: not complete
    write_adapter(d)
    info = {"step": step, "valid_loss": valid["loss"], "valid_ppl": valid["ppl"]}
    atomic_write(d / BEST_JSON, lambda p: Path(p).write_text(json.dumps(info, indent=2) + "\n"))
    return d


def read_best(out_dir: Path) -> dict[str, float] | None:
    """best/best.json, or None where there is none (no --keep-best, or being written)."""
    f = out_dir / BEST_DIR / BEST_JSON
    return json.loads(f.read_text()) if f.exists() else None


def final_line(st: TrainState, cfg: TrainConfig, out_dir: Path, early: bool) -> str | None:
    """The line a run ends with under --keep-best or an early stop: why it stopped, and where
    the best adapter is (not kept where --keep-best was turned on by a resume after it)."""
    if not (early or cfg.keep_best) or st.best_loss is None:
        return None
    best = f"step {st.best_step}, valid loss {st.best_loss:.4f}"
    kept = read_best(out_dir)
    if kept is not None and kept.get("step") == st.best_step:
        where = f"best adapter ({best}) in {out_dir / BEST_DIR}"
    elif cfg.keep_best:
        where = f"the best was {best}, before --keep-best was given: its adapter was not kept"
    else:
        where = f"the best was {best} (--keep-best keeps its adapter)"
    if not early:
        return f"mesp: {where}"
    return (
        f"mesp: early stop at step {st.step}: {st.since_best} validations without a better "
        f"loss (--early-stop {cfg.early_stop}); {where}; final adapter in {out_dir}"
    )
