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
    where: dict[str, Path] = {}
    handles = {}
    for shard in _shards(path):
        try:
            h = safe_open(str(shard), framework="pt")
            names = list(h.keys())
        except Exception as e:  # SafetensorError, OSError: header unreadable or file truncated
            raise MespError(
                f"{shard}: not a readable safetensors file ({_first_line(e)})"
            ) from None
        _check_complete(shard)
        handles[shard] = h
        for n in names:
            where[n] = shard

    def get(name: str) -> torch.Tensor:
        shard = where[name]
        try:
            return handles[shard].get_tensor(name)
        except Exception as e:
            raise MespError(f"{shard}: cannot read tensor {name} ({_first_line(e)})") from None

    src = TensorSource(where.keys(), get, str(path))
    q = raw.get("quantization") or raw.get("quantization_config")
    if isinstance(q, dict) and "bits" in q:
        src.quant = QuantSpec(bits=int(q["bits"]), group_size=int(q.get("group_size", 64)))
    return cfg, src, raw


def _check_complete(shard: Path) -> None:
    """safetensors memory-maps lazily, so a truncated file only fails when a late tensor is read:
    compare the header's data extent with the file size up front."""
    with open(shard, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MespError(f"{shard}: truncated safetensors file (no header)")
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MespError(f"{shard}: truncated or corrupt safetensors header") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if shard.stat().st_size < 8 + n + end:
        raise MespError(
            f"{shard}: truncated safetensors file ({shard.stat().st_size} bytes, "
            f"header needs {8 + n + end})"
        )


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
