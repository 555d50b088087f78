"""What `mesp export` writes and both drivers of its .pte programs read, kept in one light module
(torch-free, model-free) so that the Python driver imports no model code: the format and version
of run_config.json and of its "executorch" section, the programs' digest, and AdamW's host-side
scalars. The native runner (runtime/) keeps the same contract in C++ (artifacts.cpp,
optimizer.cpp)."""

from __future__ import annotations

FORMAT, VERSION = "mesp-artifacts", 1  # run_config.json's "format" and "version"
ET_VERSION = 2  # its "executorch" section; 2: the loss as start / slice (/ tail) / finish
# run_config.json's section for the adapter as llama.cpp's LoRA GGUF (the file `mesp
# export-adapter` writes), null for a family with no such form: {"architecture", "alpha",
# "tensors": [{"layer", "module" (PEFT's, e.g. self_attn.q_proj), "name" (the base GGUF tensor,
# e.g. blk.0.attn_q.weight), "permute" (B's rows by llama's q/k permutation over this many
# heads; 0: as they are)}]}, in the file's tensor order: "<name>.lora_a" (r, in), ".lora_b"
# (out, r), F32. The drivers write it as ADAPTER_GGUF beside the PEFT files, named
# (general.name) after the adapter directory.
GGUF_ADAPTER, ADAPTER_GGUF = "gguf_adapter", "adapter.gguf"

ADAMW_SCALARS = (
    "decay",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "step_size",
    "bc2_sqrt",
    "eps",
)
BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults, which mesp train uses


def fnv1a64(data: bytes) -> str:
    """FNV-1a 64 of a file's bytes, as the native runner computes it (a cheap identity check:
    a truncated or foreign program is refused before ExecuTorch parses it)."""
    h = 0xCBF29CE484222325
    for b in data:  # programs hold graphs, not weights: well under a megabyte each
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def adamw_scalars(lr: float, weight_decay: float, t: int) -> dict[str, float]:
    """The host side of AdamW step t (1-based), in double as torch.optim computes them."""
    b1, b2 = BETAS
    return {
        "decay": 1 - lr * weight_decay,
        "one_minus_beta1": 1 - b1,
        "beta2": b2,
        "one_minus_beta2": 1 - b2,
        "step_size": lr / (1 - b1**t),
        "bc2_sqrt": (1 - b2**t) ** 0.5,
        "eps": EPS,
    }


__all__ = [
    "ADAMW_SCALARS", "ADAPTER_GGUF", "BETAS", "EPS", "ET_VERSION", "FORMAT", "GGUF_ADAPTER",
    "VERSION", "adamw_scalars", "fnv1a64"
]  # fmt: skip
