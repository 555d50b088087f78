"""mesp: exact-gradient LoRA fine-tuning in a small, fixed memory budget (MeSP in PyTorch)."""

from mesp.patch import patch, unpatch

__all__ = ["patch", "unpatch"]
__version__ = "0.1.0"
