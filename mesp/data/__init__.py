"""Training data: mlx-lm style jsonl, plain text, or Shakespeare, turned into `Example`s.

Row formats (one JSON object per line, as mlx-lm's `lora` reads them):
  {"text": ...}                     every token after the first is trained; EOS appended (with
                                    --mask-prompt / --train-on *-assistant: refused, no reply)
  {"prompt": ..., "completion": ...} prompt + completion + EOS; --mask-prompt trains only the
                                    completion and EOS
  {"messages": [{role, content}]}   rendered with the chat template; --mask-prompt trains only
                                    the final assistant message, --train-on all-assistant every
                                    assistant message (each with its end-of-turn marker)
  {"input_ids": [...], "loss_mask": [...]}  pre-tokenized; loss_mask (0/1, optional) aligned
                                    with input_ids, 1 = token is a trained target
Errors are one-line `MespError`s that name FILE:LINE, so a bad row in a big file is findable.
Rows are parsed in `rows`, files and splits read in `files`, packing and the resumable stream
live in `batches`; `DataConfig` (the data flags) in `config`.
"""

from mesp.batch import Batch, Example, collate
from mesp.data.batches import BatchStream, chunk_examples, iter_eval_batches
from mesp.data.config import DataConfig
from mesp.data.files import (
    default_dataset,
    load_jsonl,
    load_splits,
    load_text_files,
    split_off_valid,
)
from mesp.data.rows import pad_id_of, parse_row

__all__ = [
    "Batch",
    "BatchStream",
    "DataConfig",
    "Example",
    "chunk_examples",
    "collate",
    "default_dataset",
    "iter_eval_batches",
    "load_jsonl",
    "load_splits",
    "load_text_files",
    "pad_id_of",
    "parse_row",
    "split_off_valid",
]
