"""The drop-in wing: mesp's structured backward on users' own PyTorch / HF + PEFT models.

`functions` holds the autograd functions (each saves only what its hand backward needs),
`modules` the nn.Modules over them for users' own loops, and `patch` swaps them into an HF +
PEFT model in place (public as `mesp.patch` / `mesp.unpatch`).
"""

from mesp.nn.functions import (
    Proj,
    linear_cross_entropy,
    lora_gated_mlp,
    lora_linear,
    lora_shared_input,
)
from mesp.nn.modules import (
    ChunkedLMHeadLoss,
    FusedLoRAMLP,
    FusedLoRAProjections,
    StructuredLoRALinear,
    projection,
)

__all__ = [
    "ChunkedLMHeadLoss",
    "FusedLoRAMLP",
    "FusedLoRAProjections",
    "Proj",
    "StructuredLoRALinear",
    "linear_cross_entropy",
    "lora_gated_mlp",
    "lora_linear",
    "lora_shared_input",
    "projection",
]
