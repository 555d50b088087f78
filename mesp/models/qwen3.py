"""Qwen3: Llama plus per-head RMSNorm on q and k, and an explicit head_dim."""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="qwen3", qk_norm=True)
