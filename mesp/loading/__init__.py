"""Load a model from an HF safetensors dir, an MLX quantized dir, or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mesp.config import ModelConfig
from mesp.errors import MespError
from mesp.loading.build import TensorSource, build_model, expected_tensors
from mesp.loading.tokenizer import Tokenizer
from mesp.models.transformer import CausalLM
from mesp.quant import QuantSpec


@dataclass
class Loaded:
    model: CausalLM
    tokenizer: Tokenizer | None
    source: str
    fmt: str  # "hf" | "mlx" | "gguf" | "random"
    base: str = ""  # how the base weights are held, for the run's first line (see base_of)

    def require_tokenizer(self) -> Tokenizer:
        """The tokenizer, for commands that read text; a one-line error where there is none."""
        if self.tokenizer is None:
            raise MespError(f"{self.source}: no tokenizer found (tokenizer.json or GGUF metadata)")
        return self.tokenizer


def load_model(
    path: str | Path,
    quant: QuantSpec | None = None,
    dtype: torch.dtype = torch.float32,
    keep_stored: bool = False,
) -> Loaded:
    """`quant` quantizes full-precision weights on load; MLX checkpoints stay as packed. A GGUF
    file's llama.cpp codes are kept as stored with `keep_stored` (its float weights then stay
    dense too), else dequantized and, with `quant`, quantized again (a second rounding)."""
    p = Path(path)
    if not p.exists():
        raise MespError(f"{p}: no such file or directory")
    if p.is_file() and p.suffix == ".gguf":
        from mesp.loading.gguf import GGUFFile
        from mesp.loading.gguf_stored import RequantizeCost, describe

        with GGUFFile(p) as g:  # each tensor read from the map only when built
            cfg = ModelConfig.from_hf(g.config, source=str(p))
            stored = keep_stored and g.quantized
            cost = RequantizeCost(g, quant) if quant and g.quantized and not stored else None
            src = TensorSource(g.names, cost.tensor if cost else g.tensor, str(p))
            if stored:
                src.stored, quant = g.packed, None
            model = build_model(cfg, src, dtype, quant)
            if cost is not None:
                cost.warn()
            base = describe(g, expected_tensors(model)) if stored else ""
            return Loaded(model, g.tokenizer, str(p), "gguf", base)
    if p.is_dir():
        from mesp.loading.safetensors_dir import read_safetensors_dir

        cfg, src, _ = read_safetensors_dir(p)
        with src:  # the shards' files are closed once the model is built (or fails to be)
            model = build_model(cfg, src, dtype, quant)
        tok = Tokenizer.from_dir(p) if (p / "tokenizer.json").exists() else None
        return Loaded(model, tok, str(p), "mlx" if src.quant else "hf")
    raise MespError(
        f"{p}: expected a model directory (config.json + *.safetensors) or a .gguf file"
    )


def random_model(
    cfg: ModelConfig,
    quant: QuantSpec | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 0.02,
    device: str = "cpu",
) -> CausalLM:
    """A model of real shapes with random weights (norms at their identity value), built through
    the same path as a checkpoint, one tensor at a time. device "meta": shapes and dtypes only,
    for exact memory accounting of models that do not fit (see memory_tracker)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(cfg, dtype).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    offset = 1.0 if cfg.family == "gemma3" else 0.0

    def get(name: str) -> torch.Tensor:
        shape = shapes[name]
        if device == "meta":
            return torch.empty(shape, device="meta")
        if name.endswith("norm.weight"):
            return torch.full(shape, 1.0 - offset)
        return torch.randn(shape, generator=g) * std

    source = "meta" if device == "meta" else "random"
    return build_model(cfg, TensorSource(shapes.keys(), get, source), dtype, quant)
