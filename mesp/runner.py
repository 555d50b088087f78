"""`mesp.runner`, the public name of the artifact runner (`mesp.ondevice.runner`): it trains the
adapters from `mesp export`'s files and imports only torch and safetensors, never mesp's model
code. `python -m mesp.runner ARTIFACTS --data ROWS …` runs it on its own."""

import sys

from mesp.ondevice.runner import (
    PEFT_PREFIX,
    Artifacts,
    RunConfig,
    RunnerError,
    Trainer,
    add_arguments,
    batches,
    main,
    make_batch,
    make_optimizer,
    pickled_member,
    read_rows,
    run,
    run_cli,
    save_adapter,
    train,
)

__all__ = [
    "PEFT_PREFIX",
    "Artifacts",
    "RunConfig",
    "RunnerError",
    "Trainer",
    "add_arguments",
    "batches",
    "main",
    "make_batch",
    "make_optimizer",
    "pickled_member",
    "read_rows",
    "run",
    "run_cli",
    "save_adapter",
    "train",
]

if __name__ == "__main__":
    sys.exit(main())
