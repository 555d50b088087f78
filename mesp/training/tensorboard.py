"""`mesp train --tensorboard DIR`: log.jsonl's numbers as TensorBoard scalars.

Written through the tensorboard package's own event-file writer (no TensorFlow needed), one
event per log.jsonl row at the row's step, flushed as each row is, so a killed run loses no more
here than in log.jsonl. Tags follow the row's keys: `valid_loss` → `valid/loss`, `*_mb` (peak
RSS, CUDA peak) → `memory/*`, the rest → `train/*` (`train/loss`, `train/lr`,
`train/tokens_per_s`, …).

A run (fresh or resumed) starts its own event file in DIR with a SessionLog START at its first
step: TensorBoard then drops whatever earlier files in DIR logged from that step on (steps a
killed run logged after its last checkpoint, which the resume repeats), and the steps continue.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mesp.errors import MespError

INSTALL = "pip install 'mesp[tensorboard]'"


def require_tensorboard(logdir: Path) -> None:
    """Fail before the model is loaded, not after: the package is missing, or DIR cannot be
    made."""
    _modules()
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MespError(f"{logdir}: cannot write TensorBoard events ({e.strerror})") from None


def _modules():  # type: ignore[no-untyped-def]
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise MespError(f"--tensorboard needs the tensorboard package ({INSTALL})") from None
    return event_pb2, summary_pb2, EventFileWriter


def tag(key: str) -> str:
    """The TensorBoard tag of a log.jsonl key."""
    if key.startswith("valid_"):
        return "valid/" + key.removeprefix("valid_")
    if key.endswith("_mb"):
        return "memory/" + key
    return "train/" + key


class TensorBoardLog:
    """Scalars for one run's rows, in a new event file under `logdir`."""

    def __init__(self, logdir: Path, first_step: int) -> None:
        self._event, self._summary, writer = _modules()
        try:
            self._writer = writer(str(logdir), flush_secs=10)
        except OSError as e:
            raise MespError(f"{logdir}: cannot write TensorBoard events ({e.strerror})") from None
        start = self._event.SessionLog(status=self._event.SessionLog.START)
        self._write(self._event.Event(wall_time=time.time(), step=first_step, session_log=start))

    def add(self, row: dict[str, Any]) -> None:
        """Every number of a log.jsonl row but its step (a skipped step's row has none)."""
        values = [
            self._summary.Summary.Value(tag=tag(k), simple_value=float(v))
            for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if values:
            summary = self._summary.Summary(value=values)
            self._write(self._event.Event(wall_time=time.time(), step=row["step"], summary=summary))

    def _write(self, event: Any) -> None:
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
