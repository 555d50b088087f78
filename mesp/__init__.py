"""mesp: exact-gradient LoRA fine-tuning in a small, fixed memory budget (MeSP in PyTorch)."""

__version__ = "0.1.0"
