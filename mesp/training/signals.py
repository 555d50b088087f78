"""What the training loop does about signals and the terminal: a SIGINT/SIGTERM lets the step
finish and the state be saved (`SignalFlag`, `Interrupted`), and the live progress line."""

from __future__ import annotations

import signal
import threading
from typing import Any

from mesp.training.config import TrainConfig


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived: the step finished, state and adapter were saved."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class SignalFlag:
    """While active, SIGINT/SIGTERM only set a flag: the loop finishes the step and saves.
    A second signal interrupts at once."""

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> SignalFlag:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def progress_bar(cfg: TrainConfig, done: int):  # type: ignore[no-untyped-def]
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=done, desc="train", unit="step", dynamic_ncols=True)
