"""The training wing: one loop for every engine, its flags, state, schedule and data parallelism."""

from mesp.training.config import TrainConfig, TrainResult
from mesp.training.loop import Interrupted, train

__all__ = ["Interrupted", "TrainConfig", "TrainResult", "train"]
