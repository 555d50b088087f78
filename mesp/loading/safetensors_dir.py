"""HF safetensors directories (sharded or not) and MLX quantized directories (mlx-community
`*-4bit` layout: packed uint32 `weight` + `scales` + `biases`, config.json "quantization")."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from mesp.config import ModelConfig
from mesp.errors import MespError
from mesp.loading.build import TensorSource
from mesp.quant import QuantSpec


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise MespError(f"{index}: malformed index: {e}") from None
        shards = [path / f for f in files]
        for s in shards:
            if not s.exists():
                raise MespError(f"{index}: shard {s.name} is missing")
        return shards
    shards = sorted(path.glob("*.safetensors"))
    shards = [s for s in shards if not s.name.startswith("adapter")]
    if not shards:
        raise MespError(f"{path}: no *.safetensors weights found")
    return shards


def read_safetensors_dir(path: Path) -> tuple[ModelConfig, TensorSource, dict]:
    """Config, a lazy tensor source over all shards, and the raw config dict."""
    cfg_path = path / "config.json"
    cfg = ModelConfig.from_file(cfg_path)
    raw = json.loads(cfg_path.read_text())
    where: dict[str, tuple[Path, str]] = {}  # our (HF text-model) name -> (shard, stored name)
    handles = {}
    multimodal = raw.get("model_type") == "gemma3" and "text_config" in raw
    for shard in _shards(path):
        _check_complete(shard)
        try:
            h = safe_open(str(shard), framework="pt")
            names = list(h.keys())
        except Exception as e:  # SafetensorError, OSError: header unreadable or file truncated
            raise MespError(
                f"{shard}: not a readable safetensors file ({_first_line(e)})"
            ) from None
        handles[shard] = h
        for n in names:
            ours = _text_model_name(n) if multimodal else n
            if ours is not None:
                where[ours] = (shard, n)

    def get(name: str) -> torch.Tensor:
        shard, stored = where[name]
        try:
            return handles[shard].get_tensor(stored)
        except Exception as e:
            raise MespError(f"{shard}: cannot read tensor {name} ({_first_line(e)})") from None

    src = TensorSource(where.keys(), get, str(path))
    q = raw.get("quantization") or raw.get("quantization_config")
    if isinstance(q, dict) and "bits" in q:
        src.quant = quant_spec(q, cfg_path)
    return cfg, src, raw


def quant_spec(q: dict, cfg_path: Path) -> QuantSpec:
    """config.json's MLX "quantization" block ({"bits": 4, "group_size": 64})."""
    bits, group = q["bits"], q.get("group_size", 64)
    if type(bits) is not int or type(group) is not int:
        raise MespError(
            f"{cfg_path}: quantization bits and group_size must be integers, got "
            f"{bits!r} and {group!r}"
        )
    try:
        return QuantSpec(bits=bits, group_size=group)
    except MespError as e:
        raise MespError(f"{cfg_path}: {e}") from None


def _text_model_name(name: str) -> str | None:
    """A Gemma 3 multimodal checkpoint's tensor under the text model's name, or None for the
    vision tower and projector (mesp trains the language model). transformers 5 stores
    `model.language_model.*`, 4.x `language_model.model.*` (and `language_model.lm_head`)."""
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith(("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                        "multi_modal_projector.")):  # fmt: skip
        return None
    return name


def _check_complete(shard: Path) -> None:
    """safetensors memory-maps lazily, so a truncated file only fails when a late tensor is read:
    validate the header and compare its data extent with the file size up front."""
    size = shard.stat().st_size
    with open(shard, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or n > size - 8:
            raise MespError(f"{shard}: truncated safetensors file (header cut off)")
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            AttributeError,
            KeyError,
            TypeError,
            IndexError,
            ValueError,
            RecursionError,
        ):
            raise MespError(f"{shard}: corrupt safetensors header") from None
    if size < 8 + n + max(ends, default=0):
        raise MespError(
            f"{shard}: truncated safetensors file ({size} bytes, header needs {8 + n + max(ends)})"
        )


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
