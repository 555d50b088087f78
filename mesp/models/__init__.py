"""Model families: one decoder (`transformer.py`) and one small spec per family."""

from mesp.models import gemma2, gemma3, granite, llama, mistral, olmo2, phi3, qwen2, qwen3, smollm3
from mesp.models.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {
    m.SPEC.name: m.SPEC
    for m in (llama, qwen2, qwen3, gemma3, mistral, smollm3, granite, olmo2, gemma2, phi3)
}
