"""Granite 3: Llama plus four scalars, all in ModelConfig.

embedding_multiplier (embeddings ×), residual_multiplier (each residual branch × before the add),
attention_multiplier (the softmax scale) and logits_scaling (logits ÷, applied as the final
norm's output scale: the head is linear, so (h/s)Wᵀ = (hWᵀ)/s).
"""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="granite")
