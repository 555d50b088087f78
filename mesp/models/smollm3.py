"""SmolLM3: Llama plus layers without rotary embedding (NoPE, every 4th by default).

Which layers rotate (HF's `no_rope_layers`) lives in ModelConfig.rope_layers; with
`use_sliding_window`, transformers gives the NoPE layers the window (ModelConfig.layer_types).
"""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="smollm3")
