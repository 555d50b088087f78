"""The commands' own flags, one dataclass field per flag (help and default beside it).

The model, data, LoRA and training flags live beside the code that reads them (ModelOptions,
DataConfig, LoraConfig, TrainConfig); these are the rest: how gradients are computed, where a
run writes, and what eval / generate / grad take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mesp.engines import ENGINES


@dataclass
class EngineOptions:
    engine: str = field(
        default="mesp",
        metadata={
            "help": "gradient engine: bp (autograd), mebp (block checkpoints + autograd "
            "recompute), mesp (structured hand backward), mezo (zeroth order, forward only)",
            "choices": ENGINES,
        },
    )
    h_strategy: str = field(
        default="recompute",
        metadata={
            "help": "mesp: recompute LoRA's h = xAᵀ in backward, or store it (ablation)",
            "choices": ("recompute", "store"),
        },
    )
    offload: str = field(
        default="none",
        metadata={
            "help": "mebp/mesp: keep block checkpoints in memory, host memory, or on disk",
            "choices": ("none", "cpu", "disk"),
        },
    )
    offload_dir: str | None = field(
        default=None, metadata={"help": "directory for --offload disk / --stream-weights files"}
    )
    stream_weights: bool = field(
        default=False,
        metadata={"help": "mesp: frozen block weights on disk, one block in memory at a time"},
    )
    offload_fallback: bool = field(
        default=False,
        metadata={"help": "if the offload disk fails or fills, keep checkpoints in memory"},
    )
    zo_eps: float = field(default=1e-2, metadata={"help": "mezo: perturbation size"})
    zo_samples: int = field(default=1, metadata={"help": "mezo: SPSA probes per step"})
    zo_full: bool = field(
        default=False,
        metadata={
            "help": "mezo: perturb and train every weight, not only the adapters (needs "
            "--quantize none; the trained model is written to ADAPTER_OUT/model)"
        },
    )
    loss: str = field(
        default="ce",
        metadata={
            "help": "exact cross-entropy, or softmax over targets + a vocabulary subset "
            "(approximate)",
            "choices": ("ce", "sampled-softmax"),
        },
    )
    vocab_subset: int = field(
        default=1000,
        metadata={
            "help": "sampled-softmax: tokens besides the targets (half top-K of the head at "
            "probe rows, half drawn uniformly)",
            "metavar": "K",
        },
    )
    logits_masking: bool = field(
        default=True,
        metadata={"help": "form logits only for trained tokens (--no-logits-masking: all)"},
    )


@dataclass
class RunOptions:
    config: str | None = field(
        default=None, metadata={"help": "YAML/TOML file of flag values (flags given here win)"}
    )
    adapter_out: str = field(
        default="adapters", metadata={"help": "directory for the adapter, state and logs"}
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "continue the run saved in DIR (its flags are the defaults)",
            "metavar": "DIR",
        },
    )
    max_memory: str | None = field(
        default=None,
        metadata={
            "help": "memory budget, e.g. 500MB: refuse a setup the planner says won't fit, "
            "stop and save if the measured peak crosses it"
        },
    )
    nproc: int = field(
        default=1, metadata={"help": "data-parallel processes on this machine (launches torchrun)"}
    )
    master_port: int = field(default=29517, metadata={"help": "torchrun rendezvous port"})
    dist_timeout: float = field(
        default=120.0, metadata={"help": "seconds before surviving ranks give up on a dead one"}
    )


@dataclass
class EvalOptions:
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter directory"})
    batch_size: int = field(default=4, metadata={"help": "sequences per batch"})
    max_batches: int = field(default=0, metadata={"help": "batches to score (0 = all)"})
    json: bool = field(default=False, metadata={"help": "print one JSON object"})


@dataclass
class GenerateOptions:
    prompt: str = field(default="", metadata={"help": "text to continue", "required": True})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter directory"})
    chat: bool = field(
        default=False, metadata={"help": "wrap the prompt in the model's chat template"}
    )
    max_tokens: int = field(default=64, metadata={"help": "new tokens at most"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature (0 = greedy)"})
    top_p: float = field(
        default=1.0, metadata={"help": "nucleus sampling: smallest token set with this mass"}
    )
    seed: int = field(default=0, metadata={"help": "sampling seed"})


@dataclass
class GradOptions:
    out: str = field(
        default="", metadata={"help": "output .safetensors (PEFT key names)", "required": True}
    )
    adapter: str | None = field(
        default=None, metadata={"help": "adapter to differentiate (default: a fresh one)"}
    )
    init_b: float = field(
        default=0.0,
        metadata={
            "help": "fresh adapter only: std of a random lora_B (0 = PEFT's zeros, which makes "
            "every lora_A gradient zero)"
        },
    )
    batch_size: int = field(default=1, metadata={"help": "sequences in the batch"})
    seed: int = field(default=0, metadata={"help": "seed for the fresh adapter and data order"})


@dataclass
class MergeOptions:
    adapter: str = field(default="", metadata={"help": "PEFT adapter directory", "required": True})
    out: str = field(
        default="",
        metadata={
            "help": "directory for the merged model (config.json, model.safetensors, "
            "tokenizer); with --quantize 4|8 it is written in MLX's quantized layout",
            "required": True,
        },
    )
