"""`mesp.runner`, the public name of the Python driver of `mesp export`'s .pte programs
(`mesp.ondevice.et_driver`, through executorch.runtime) and of what it shares with it
(`mesp.ondevice.runner`: the artifacts, the rows, the adapter). `python -m mesp.runner ARTIFACTS
--data ROWS …` runs it on its own; the native runner (runtime/) is its C++ twin."""

import sys

from mesp.ondevice.et_driver import EtTrainer, main, train
from mesp.ondevice.runner import (
    PEFT_PREFIX,
    Artifacts,
    RunConfig,
    RunnerError,
    add_arguments,
    batches,
    make_batch,
    read_rows,
    run,
    run_cli,
    save_adapter,
)

__all__ = [
    "PEFT_PREFIX",
    "Artifacts",
    "EtTrainer",
    "RunConfig",
    "RunnerError",
    "add_arguments",
    "batches",
    "main",
    "make_batch",
    "read_rows",
    "run",
    "run_cli",
    "save_adapter",
    "train",
]

if __name__ == "__main__":
    sys.exit(main())
