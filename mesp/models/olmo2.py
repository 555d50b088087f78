"""OLMo 2: Llama with the norms moved after each branch, and q/k norms over whole projections.

Per block: x2 = x + norm_a(attn(x)), y = x2 + norm_f(mlp(x2)) (no input norm; HF's
post_attention_layernorm / post_feedforward_layernorm). q_norm / k_norm are one RMSNorm over
the whole q (H·D) / k (KV·D) projection of a token, not per head (mesp.ops.norm.rms_norm_heads).
"""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="olmo2", qk_norm=True, qk_norm_whole=True, post_norms=True)
