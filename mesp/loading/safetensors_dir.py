"""HF safetensors directories (sharded or not) and MLX quantized directories (mlx-community
`*-4bit` layout: packed uint32 `weight` + `scales` + `biases`, config.json "quantization").

Tensors are read from the file into memory of their own, not viewed through a memory map:
safetensors' `get_tensor` returns views of one mapping of the whole file, so a single kept view
(a norm, a bias, a dense or packed weight) would keep the whole file mapped, and every page read
while quantizing resident, for as long as the model lives. safetensors still validates each
header; its handle is closed, and the file unmapped, before the first tensor is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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


# safetensors' dtype names; float8 and the wide unsigned types where this torch has them
DTYPES = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
        "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    }.items()
    if hasattr(torch, attr)
}  # fmt: skip


@dataclass(frozen=True)
class _Entry:
    """Where one stored tensor's bytes lie: [start, stop) are offsets in the file."""

    shard: Path
    stored: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def read_safetensors_dir(path: Path) -> tuple[ModelConfig, TensorSource, dict]:
    """Config, a lazy tensor source over all shards, and the raw config dict. The source holds
    open files (no mappings) until it is closed; load_model closes it once the model is built."""
    cfg_path = path / "config.json"
    cfg = ModelConfig.from_file(cfg_path)
    raw = json.loads(cfg_path.read_text())
    where: dict[str, _Entry] = {}  # our (HF text-model) name -> where its bytes are
    multimodal = raw.get("model_type") == "gemma3" and "text_config" in raw
    for shard in _shards(path):
        header, data_start = _check_complete(shard)
        try:
            with safe_open(str(shard), framework="pt") as h:
                names = list(h.keys())
        except Exception as e:  # SafetensorError, OSError: header unreadable or file truncated
            raise MespError(
                f"{shard}: not a readable safetensors file ({_first_line(e)})"
            ) from None
        for n in names:
            ours = _text_model_name(n) if multimodal else n
            if ours is not None:
                where[ours] = _entry(shard, n, header.get(n), data_start)
    files: dict[Path, BinaryIO] = {}
    closed = False

    def get(name: str) -> torch.Tensor:
        e = where[name]
        if closed:
            raise MespError(f"{e.shard}: read after close")
        try:
            if e.shard not in files:
                files[e.shard] = open(e.shard, "rb", buffering=0)  # closed by close()
            return _read(files[e.shard], e)
        except OSError as err:
            raise MespError(f"{e.shard}: cannot read tensor {name} ({_first_line(err)})") from None

    def close() -> None:
        nonlocal closed
        closed = True
        while files:
            files.popitem()[1].close()

    src = TensorSource(where.keys(), get, str(path), close=close)
    q = raw.get("quantization") or raw.get("quantization_config")
    if isinstance(q, dict) and "bits" in q:
        src.quant = quant_spec(q, cfg_path)
    return cfg, src, raw


def _entry(shard: Path, stored: str, info: object, data_start: int) -> _Entry:
    """One header entry, checked again here because these offsets (not safetensors' own reading
    of the header) say which bytes are read: known dtype, sizes that agree."""
    bad = MespError(f"{shard}: corrupt safetensors header entry for {stored}")
    if not isinstance(info, dict):
        raise bad
    try:
        dtype = DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise bad from None
    if min(shape, default=0) < 0 or begin < 0 or end - begin != math.prod(shape) * dtype.itemsize:
        raise bad
    return _Entry(shard, stored, dtype, shape, data_start + begin, data_start + end)


def _read(f: BinaryIO, e: _Entry) -> torch.Tensor:
    """The tensor's bytes read straight into a fresh tensor (in a loop: one read(2) returns at
    most about 2 GiB). The bytes are little-endian, as the format and every torch host are."""
    out = torch.empty(e.stop - e.start, dtype=torch.uint8)
    view, done = memoryview(out.numpy()), 0
    f.seek(e.start)
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise OSError(f"file ends at byte {e.start + done}, tensor needs {e.stop}")
        done += got
    return out.view(e.dtype).reshape(e.shape)


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


def _check_complete(shard: Path) -> tuple[dict, int]:
    """A truncated file would only fail when a late tensor is read: validate the header and
    compare its data extent with the file size up front. Returns the header and the offset at
    which the data begins."""
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
    return header, 8 + n


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
