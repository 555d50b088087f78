"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with fused projections.

`qkv_proj` is one linear to (H + 2·KV)·D, split q | k | v; `gate_up_proj` one linear to 2·I,
split gate | up. LoRA sits on the fused linears as PEFT names them on Phi3ForCausalLM, so an
adapter is PEFT's unchanged. partial_rotary_factor (Phi-4-mini rotates 3/4 of each head) and
LongRoPE (short / long factor sets, the attention factor on cos/sin) live in ModelConfig's
RopeSpec; a `sliding_window` puts every layer on that window, as Phi3Model's mask does.
"""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="phi3", fused_proj=True)
