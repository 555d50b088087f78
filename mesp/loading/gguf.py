"""Read a llama.cpp GGUF file into an HF-shaped config, HF-named float32 tensors and a tokenizer.

We parse the header ourselves instead of using `gguf.GGUFReader`: the reader builds a numpy view
per array element, which takes ~25 s for Gemma 3's 262k-token vocabulary, and it reports
truncation as assorted numpy errors. Dequantization is left to `gguf.quants.dequantize`.

llama.cpp's converter changes some tensors on the way in; `_undo_converter` reverses that, so the
result equals what `transformers` loads from the same file (checked in tests/test_real_gguf.py).
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quant_shape_to_byte_shape
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from mesp.errors import MespError
from mesp.loading.gguf_tokenizer import tokenizer_from_gguf
from mesp.loading.tokenizer import Tokenizer

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# Q5_0/Q5_1 are here because llama.cpp's Q4_K_M mixes use them (Gemma 3 270M has 81 Q5_0 tensors).
SUPPORTED_TYPES = {
    QT.F32,
    QT.F16,
    QT.BF16,
    QT.Q8_0,
    QT.Q4_0,
    QT.Q4_1,
    QT.Q5_0,
    QT.Q5_1,
    QT.Q4_K,
    QT.Q5_K,
    QT.Q6_K,
}
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    **{f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"ffn_{x}.weight": f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")},
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Gemma 3 has four norms per block; llama.cpp names the pre-MLP one ffn_norm like llama's.
_GEMMA_LAYER = {
    **_LAYER,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_CORE = [
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_norm",
]
_QK_NORM = ["attn_q_norm", "attn_k_norm"]
_REQUIRED = {
    "llama": _CORE,
    "qwen2": _CORE,
    "qwen3": _CORE + _QK_NORM,
    "gemma3": _CORE + _QK_NORM + ["post_attention_norm", "post_ffw_norm"],
}


class _Info(NamedTuple):
    qtype: QT
    shape: tuple[int, ...]  # numpy order (ggml's dims reversed), i.e. HF's [out, in]
    start: int  # absolute byte offset in the file
    nbytes: int


class _Header:
    """Sequential little-endian reader over the mapped file; running off the end = truncation."""

    def __init__(self, buf: mmap.mmap, where: str) -> None:
        self.buf, self.pos, self.where = buf, 0, where

    def take(self, n: int) -> int:
        if self.pos + n > len(self.buf):
            raise MespError(
                f"{self.where}: truncated GGUF file (header runs past the end, "
                f"byte {len(self.buf)})"
            )
        self.pos += n
        return self.pos - n

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            if depth >= 4:  # real files nest one level (arrays of strings or numbers)
                raise MespError(f"{self.where}: corrupt GGUF file (arrays nested too deeply)")
            sub, n = self.scalar(4), self.scalar(10)
            if sub in _SCALAR:  # numeric arrays (scores, token types) in one numpy read
                dt = np.dtype(_SCALAR[sub])
                return np.frombuffer(self.buf, dt, n, self.take(n * dt.itemsize)).tolist()
            return [self.value(sub, depth + 1) for _ in range(n)]
        if vtype not in _SCALAR:
            raise MespError(f"{self.where}: corrupt GGUF file (unknown metadata type {vtype})")
        return self.scalar(vtype)


def _shown(name: str) -> str:
    """A tensor name as an error message shows it: quoted, escaped, at most 64 characters (a
    corrupt file's name may hold newlines or megabytes, and errors stay one line)."""
    return repr(name if len(name) <= 64 else name[:64] + "...")


def _parse(
    buf: mmap.mmap, where: str, kinds: dict[str, tuple[int, int | None]] | None = None
) -> tuple[dict[str, Any], dict[str, _Info]]:
    """(metadata, tensor infos); `kinds`, when given, gets each key's value type (and an array's
    element type), so a writer can copy keys exactly (mesp.convert.gguf_model)."""
    h = _Header(buf, where)
    if len(buf) < 4 or buf[:4] != b"GGUF":
        raise MespError(f"{where}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    h.take(4)
    version = h.scalar(4)
    if version & 0xFFFF == 0:
        raise MespError(f"{where}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise MespError(f"{where}: unsupported GGUF version {version} (need 2 or 3)")
    n_tensors, n_kv = h.scalar(10), h.scalar(10)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, vtype = h.string(), h.scalar(4)
        if kinds is not None:
            arr = vtype == 9 and h.pos + 4 <= len(buf)  # a cut file fails in h.value
            sub = struct.unpack_from("<I", buf, h.pos)[0] if arr else None
            kinds[key] = (vtype, sub)
        meta[key] = h.value(vtype)
    raw = []
    for _ in range(n_tensors):
        name, ndim = h.string(), h.scalar(4)
        if ndim > 4:
            raise MespError(f"{where}: corrupt GGUF file (tensor {_shown(name)} has {ndim} dims)")
        dims = [h.scalar(10) for _ in range(ndim)]
        raw.append((name, dims, h.scalar(4), h.scalar(10)))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise MespError(f"{where}: corrupt GGUF file (general.alignment = {align!r})")
    data_start = (h.pos + align - 1) // align * align
    infos: dict[str, _Info] = {}
    for name, dims, type_id, offset in raw:
        try:
            qtype = QT(type_id)
        except ValueError:
            raise MespError(
                f"{where}: tensor {_shown(name)} has unknown ggml type id {type_id}"
            ) from None
        if qtype not in SUPPORTED_TYPES:
            raise MespError(
                f"{where}: tensor {_shown(name)} has unsupported quant type {qtype.name} "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
            )
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not dims or dims[0] % block:
            raise MespError(f"{where}: corrupt GGUF file (tensor {_shown(name)} dims {dims})")
        nbytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise MespError(
                f"{where}: truncated GGUF file (tensor {_shown(name)} ends at byte "
                f"{start + nbytes}, file has {len(buf)})"
            )
        infos[name] = _Info(qtype, tuple(reversed(dims)), start, nbytes)
    return meta, infos


def _hf_config(meta: dict[str, Any], infos: dict[str, _Info], arch: str, where: str) -> dict:
    def get(key: str, default: Any = ...) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            if default is ...:
                raise MespError(f"{where}: missing metadata key '{full}'")
            return default
        return meta[full]

    if "token_embd.weight" not in infos:
        raise MespError(f"{where}: missing tensor 'token_embd.weight'")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    # head_dim: explicit key_length (qwen3, gemma3), else rope dims (llama), else hidden/heads.
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
    cfg: dict[str, Any] = {
        "model_type": ARCHS[arch],
        "vocab_size": infos["token_embd.weight"].shape[0],  # rows the model actually has
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 1e6 if arch == "gemma3" else 1e4)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in infos,
        "attention_bias": "blk.0.attn_q.bias" in infos,
        "hidden_act": "silu",
        "rope_scaling": None,
    }
    # A corrupt block_count (say 2**27) must fail here, not after listing 2**27 blocks' names.
    held = {int(b) for b in (n.split(".")[1] for n in infos if n.startswith("blk.")) if b.isdigit()}
    n = cfg["num_hidden_layers"]
    first = next((i for i in range(min(n, len(held) + 1)) if i not in held), None)
    if first is not None:
        raise MespError(
            f"{where}: missing tensor 'blk.{first}.{_REQUIRED[arch][0]}.weight' (block_count "
            f"is {n}, the file holds {len(held)} blocks)"
        )
    for key, tok_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        cfg[f"{key}_token_id"] = meta.get(f"tokenizer.ggml.{tok_key}_token_id")
    kind = get("rope.scaling.type", "none")
    if kind != "none":
        cfg["rope_scaling"] = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
        if (orig := get("rope.scaling.original_context_length", None)) is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    if arch == "gemma3":
        n = cfg["num_hidden_layers"]
        pattern = get("attention.sliding_window_pattern", 6)  # llama.cpp's built-in default
        sliding = (
            [bool(x) for x in pattern]
            if isinstance(pattern, list)
            else [(i + 1) % int(pattern) != 0 for i in range(n)]
        )
        # llama.cpp: attention scale is 1/sqrt(hidden/heads) for 27B (62 layers), else head_dim.
        scale = get("attention.scale", None)
        del cfg["hidden_act"]
        cfg.update(
            {
                "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": int(get("attention.sliding_window")),
                "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
                "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
                "query_pre_attn_scalar": (
                    1.0 / scale**2 if scale else hidden // heads if n == 62 else head_dim
                ),
                "final_logit_softcapping": get("final_logit_softcapping", None),
                "attn_logit_softcapping": get("attn_logit_softcapping", None),
            }
        )
    return cfg


def _llama3_rope_scaling(factors: np.ndarray, cfg: dict, where: str) -> dict | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's precomputed `rope_freqs` tensor.

    The converter bakes Meta's llama3 formula into per-frequency divisors. We try Meta's values
    (low 1, high 4, original 8192: every Llama 3.x), else fit low/high from the smoothly
    interpolated band, and accept the result only if it reproduces every stored divisor.
    """
    dim = cfg["head_dim"]
    inv_wavelen = 1.0 / cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_wavelen /= 2 * math.pi
    factor, orig = float(factors.max()), 8192
    if factor <= 1.0:
        return None

    def divisors(low: float, high: float) -> np.ndarray:
        smooth = np.clip((orig * inv_wavelen - low) / (high - low), 0.0, 1.0)
        return 1.0 / ((1 - smooth) / factor + smooth)

    low, high = 1.0, 4.0
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if (
        factors.shape == inv_wavelen.shape
        and not np.allclose(factors, divisors(low, high), rtol=1e-4)
        and mid.sum() >= 2
    ):
        # smooth = (orig / wavelen - low) / (high - low) is linear in 1 / wavelen.
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, icept = np.polyfit(inv_wavelen[mid], smooth, 1)
        low = float(-icept * orig / slope)
        high = low + float(orig / slope)
    if factors.shape != inv_wavelen.shape or not np.allclose(
        factors, divisors(low, high), rtol=1e-4
    ):
        raise MespError(f"{where}: rope_freqs tensor does not match Llama 3 rope scaling")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def _undo_converter(name: str, w: np.ndarray, arch: str, cfg: dict, where: str) -> np.ndarray:
    """Reverse llama.cpp's convert_hf_to_gguf.py edits (see module docstring)."""
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        # LlamaModel.permute interleaves each head's rotary halves for ggml's GPT-J-style rope.
        n = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        if w.shape[0] % (2 * n):
            raise MespError(
                f"{where}: tensor {_shown(name)} has {w.shape[0]} rows, not {n} rope heads"
            )
        w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    if arch == "gemma3" and name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # Gemma3Model stores HF's (1 + w) RMSNorm scale; q/k norms too
    return w


class GGUFFile:
    """An open llama.cpp GGUF file: the HF config and tokenizer are parsed at open; each tensor
    is dequantized from the memory map only when `tensor(name)` asks for it, so loading peaks at
    one float32 tensor on top of the model being built (not the whole model in float32)."""

    def __init__(self, path: Path) -> None:
        self.where = where = str(path)
        try:
            with open(path, "rb") as f:
                if Path(path).stat().st_size == 0:  # mmap cannot map an empty file
                    raise MespError(f"{where}: not a GGUF file (empty)")
                self._buf: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise MespError(f"{where}: cannot open: {e.strerror}") from None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        where, buf = self.where, self._buf
        assert buf is not None
        meta, infos = _parse(buf, where)
        arch = meta.get("general.architecture")
        if arch not in ARCHS:
            raise MespError(
                f"{where}: general.architecture = {arch!r} is not supported ({', '.join(ARCHS)})"
            )
        try:
            cfg = _hf_config(meta, infos, arch, where)
        except (TypeError, ValueError) as e:  # a key holding the wrong kind of value
            raise MespError(f"{where}: bad metadata value: {e}") from None
        self.tokenizer = tokenizer_from_gguf(meta, where)
        layer_map = _GEMMA_LAYER if arch == "gemma3" else _LAYER
        n_layers = cfg["num_hidden_layers"]
        wanted = [f"blk.{i}.{t}.weight" for i in range(n_layers) for t in _REQUIRED[arch]]
        wanted += [
            f"blk.{i}.attn_{x}.bias" for i in range(n_layers) for x in "qkv" if arch == "qwen2"
        ] + ["output_norm.weight"]
        if missing := [n for n in wanted if n not in infos]:
            raise MespError(f"{where}: missing tensor '{missing[0]}' ({len(missing)} missing)")
        self._by_hf: dict[str, str] = {}  # HF name -> GGUF name, checked before any dequantizing
        for name in infos:
            blk, layer, leaf = (name.split(".", 2) + ["", ""])[:3]
            if name in _GLOBAL:
                self._by_hf[_GLOBAL[name]] = name
            elif blk == "blk" and layer.isdigit() and int(layer) < n_layers and leaf in layer_map:
                self._by_hf[f"model.layers.{layer}.{layer_map[leaf]}"] = name
            elif name != "rope_freqs.weight" or arch != "llama":
                raise MespError(
                    f"{where}: unexpected tensor {_shown(name)} for architecture {arch}"
                )
        self._infos, self._arch, self.config = infos, arch, cfg
        if "rope_freqs.weight" in infos:  # Llama 3 rope scaling, folded into the config
            freqs = self._values("rope_freqs.weight").astype(np.float64)
            cfg["rope_scaling"] = _llama3_rope_scaling(freqs, cfg, where)

    def _values(self, name: str) -> np.ndarray:
        if self._buf is None:
            raise MespError(f"{self.where}: read after close")
        info = self._infos[name]
        raw = np.frombuffer(self._buf, np.uint8, info.nbytes, info.start)
        values = dequantize(
            raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype)), info.qtype
        )
        if np.may_share_memory(values, raw):  # F32 dequantizes to a view of the map
            values = values.copy()
        return values

    @property
    def names(self) -> list[str]:
        """HF names of the tensors this file holds."""
        return list(self._by_hf)

    def tensor(self, hf_name: str) -> torch.Tensor:
        """One float32 tensor under its HF name, with llama.cpp's converter edits undone."""
        name = self._by_hf[hf_name]
        values = _undo_converter(name, self._values(name), self._arch, self.config, self.where)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def close(self) -> None:
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:  # a numpy view is still alive somewhere; the GC will unmap it
                pass
            self._buf = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metadata(path: Path) -> dict[str, tuple[Any, int, int | None]]:
    """Every metadata key of a GGUF file as (value, GGUF value type, array element type or
    None), tensors left unread."""
    kinds: dict[str, tuple[int, int | None]] = {}
    with GGUFFile(path) as g:
        assert g._buf is not None
        meta, _ = _parse(g._buf, g.where, kinds)
    return {k: (v, *kinds[k]) for k, v in meta.items()}


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer]:
    """Return (hf_config, float32 HF-named tensors, tokenizer): every tensor at once (tests,
    tools); `load_model` goes through GGUFFile and reads one tensor at a time instead."""
    with GGUFFile(path) as g:
        return g.config, {n: g.tensor(n) for n in g.names}, g.tokenizer
