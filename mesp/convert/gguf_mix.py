"""The per-tensor type mix of llama.cpp's k-quant file types, as llama-quantize chooses it
(src/llama-quant.cpp, llama_tensor_get_type) for a dense model without an importance matrix,
and the byte maker for every type mesp writes.

For the three file types mesp writes, the rules are:
- output.weight, and token_embd.weight when there is no output.weight (tied embeddings):
  Q6_K, or Q8_0 when the row length is not a multiple of 256;
- q4_k_m / q5_k_m: attn_v.weight and ffn_down.weight of the "use_more_bits" layers get Q6_K:
  the first and last eighth of the layers and every third layer between; a fused
  attn_qkv.weight (Phi-3) gets Q5_K / Q6_K in every layer;
- every other 2-D weight (token_embd of an untied model included): the file type's own
  (Q4_K / Q5_K / Q6_K); 1-D tensors and norms stay F32 (llama.cpp quantizes neither).
Then the shape fallback: a row length that 256 does not divide gets Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when 32 does not divide it either (where llama.cpp gives
up on Q8_0 rows, mesp's writer falls back to F16 as it does for --gguf-type q8_0).
"""

from __future__ import annotations

import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType as FT

from mesp.convert.gguf_kquant import KQUANTS, quantize_k

# --gguf-type -> (the file type's own tensor type, general.file_type)
MIXES = {
    "q4_k_m": (QT.Q4_K, FT.MOSTLY_Q4_K_M),
    "q5_k_m": (QT.Q5_K, FT.MOSTLY_Q5_K_M),
    "q6_k": (QT.Q6_K, FT.MOSTLY_Q6_K),
}
FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}
LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layers that get more bits in the _M mixes."""
    return (
        i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2
    )


def fits(qtype: QT, ncols: int) -> QT:
    """llama.cpp's fallback for a row length the block size does not divide."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if ncols % block == 0:
        return qtype
    qtype = FALLBACK.get(qtype, qtype)
    return qtype if ncols % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else QT.F16


def mix_type(name: str, shape: tuple[int, ...], mix: str, n_layer: int, tied: bool) -> QT:
    """The stored type of GGUF tensor `name` (HF `shape`: rows last) in a `mix` file."""
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return QT.F32
    own, _ = MIXES[mix]
    ncols = shape[-1]
    layer = LAYER.match(name)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = QT.Q8_0 if ncols % 256 else QT.Q6_K
    elif (
        mix in ("q4_k_m", "q5_k_m")
        and layer is not None
        and ("attn_v.weight" in name or "ffn_down" in name)
        and use_more_bits(int(layer.group(1)), n_layer)
    ):
        qtype = QT.Q6_K
    elif "attn_qkv.weight" in name and mix in ("q4_k_m", "q5_k_m"):  # Phi-3's fused q|k|v
        qtype = QT.Q5_K if mix == "q4_k_m" else QT.Q6_K
    else:
        qtype = own
    return fits(qtype, ncols)


def quantize(w32: np.ndarray, qtype: QT) -> np.ndarray:
    """A float32 tensor -> its `qtype` bytes: the k-quants by gguf_kquant, the rest by gguf-py
    (which has no k-quant quantizer)."""
    if qtype in KQUANTS:
        return quantize_k(w32, qtype)
    return gguf.quants.quantize(w32, qtype)  # F32: w32 itself, no copy
