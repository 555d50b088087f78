"""Qwen2 / Qwen2.5: Llama plus q/k/v biases (set by ModelConfig.attention_bias for this family)."""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="qwen2")
