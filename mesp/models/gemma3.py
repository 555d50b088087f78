"""Gemma3 text: (1+w) RMSNorms, four per block, q/k norms, tanh-GeGLU, embeddings × √hidden.

Sliding-window layers, their separate RoPE base and query_pre_attn_scalar live in ModelConfig.
"""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(
    name="gemma3",
    qk_norm=True,
    norm_offset=1.0,
    sandwich_norms=True,
    activation="gelu_tanh",
    embed_scale=True,
)
