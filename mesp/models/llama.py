"""Llama (SmolLM2, Llama 3.2): the plain pre-norm SwiGLU decoder; every flag at its default."""

from mesp.models.spec import FamilySpec

SPEC = FamilySpec(name="llama")
