"""Mistral: Llama plus a sliding window on every layer.

The window (config.json's `sliding_window`; null: none) lives in ModelConfig: every layer is a
sliding layer then, with the same RoPE as a full one.
"""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="mistral")
