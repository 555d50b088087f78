"""`DataConfig`: where the data comes from and how rows become fixed-size examples."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from mesp.errors import MespError

OVERLONG = ("truncate", "drop", "error")
# Which tokens are targets: every one; the completion / final assistant message (--mask-prompt);
# every assistant message of {"messages"} rows.
TRAIN_ON = ("all", "last-assistant", "all-assistant")


@dataclass
class DataConfig:
    """Where the data comes from and how rows become fixed-size training examples."""

    path: str | None = field(
        default=None,
        metadata={
            "flag": "--data",
            "help": (
                "dir with train.jsonl [valid.jsonl test.jsonl], a .jsonl or text file (.txt .md "
                ".py), or a dir of text files (subdirs too); unset = built-in Shakespeare"
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
    train_on: str = field(
        default="all",
        metadata={
            "help": (
                "target tokens: all | last-assistant (as --mask-prompt) | all-assistant (every "
                "assistant message of a {messages} row, each with its end-of-turn marker)"
            ),
            "choices": TRAIN_ON,
        },
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
        if self.train_on not in TRAIN_ON:
            raise MespError(f"--train-on must be one of {', '.join(TRAIN_ON)}")
        if self.mask_prompt and self.train_on == "all-assistant":
            raise MespError(
                "--mask-prompt trains the last assistant message only; drop it to train every "
                "assistant message with --train-on all-assistant"
            )
        if self.overlong not in OVERLONG:
            raise MespError(f"overlong policy must be one of {', '.join(OVERLONG)}")
        if self.max_examples is not None and self.max_examples < 1:
            raise MespError(f"max examples must be at least 1, got {self.max_examples}")

    def check_positions(self, max_positions: int) -> None:
        """A row of seq_len positions must fit the model."""
        if self.seq_len > max_positions:
            raise MespError(
                f"--seq-len {self.seq_len} is over the model's maximum of {max_positions} positions"
            )

    def for_scoring(self) -> tuple[DataConfig, bool]:
        """As `mesp eval` and `mesp grad` read data: a file is used whole (no validation
        split); a directory or the built-in set by its split. Returns the config and whether
        the data is a single file; the config is validated."""
        whole = self.path is not None and Path(self.path).is_file()
        cfg = replace(self, valid_fraction=0.0 if whole else 0.05)
        cfg.validate()
        return cfg, whole
