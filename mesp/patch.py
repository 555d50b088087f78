"""`mesp.patch(model)` / `mesp.unpatch(model)`: the public name of `mesp.nn.patch`, which swaps
mesp's structured LoRA linear, fused MLP and chunked loss into an HF + PEFT model in place."""

from typing import Any

from mesp.nn import patch as _impl
from mesp.nn.patch import FAMILIES, PatchRecord, causal_lm, patch, patch_record, unpatch

__all__ = ["FAMILIES", "PatchRecord", "causal_lm", "patch", "patch_record", "unpatch"]


def __getattr__(name: str) -> Any:
    """Names made on demand there (StructuredPeftLinear) resolve here too."""
    return getattr(_impl, name)
