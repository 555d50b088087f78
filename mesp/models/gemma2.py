"""Gemma 2: Gemma 3's block without q/k norms ((1+w) RMSNorms, four per block, tanh-GeGLU,
embeddings × √hidden), plus attention logit soft-capping.

Sliding / global alternation, query_pre_attn_scalar, the final logit soft-cap (inside the chunked
cross-entropy) and the attention soft-cap (attn_logit_softcapping: scores cap·tanh(s/cap), only
in the query-chunked attention and its backward, mesp.ops.attention_chunked) live in ModelConfig.
"""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(
    name="gemma2",
    norm_offset=1.0,
    sandwich_norms=True,
    activation="gelu_tanh",
    embed_scale=True,
)
