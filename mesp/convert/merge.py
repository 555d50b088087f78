"""`mesp merge`: fold an adapter into its base and write a model directory that mesp,
transformers and (when quantized) MLX load: config.json + model.safetensors + tokenizer.

Unquantized, the directory is an HF checkpoint in --dtype. With --quantize 4|8 the merged
weights are requantized (MLX layout: uint32 words, scales, biases, "quantization" in
config.json), the form mlx-community publishes; mesp loads it back bit for bit.
An --out ending in .gguf writes one llama.cpp GGUF file instead (gguf_model.py), F32/F16/BF16
per --dtype or the type --gguf-type names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from mesp.atomic_io import atomic_write
from mesp.convert.gguf_model import ARCHS as GGUF_ARCHS
from mesp.convert.gguf_model import DEFAULT_TYPE, GGUF_TYPES, LazyTensor, write_model_gguf
from mesp.convert.gguf_vocab import vocab_kvs
from mesp.errors import MespError
from mesp.loading.build import expected_tensors
from mesp.loading.hub import adapter_dir
from mesp.loading.session import ModelOptions, open_model
from mesp.loading.tokenizer import Tokenizer
from mesp.lora import check_output_dir, load_adapter, merge_lora, merged_weight
from mesp.models.linear import FrozenWeight, Linear
from mesp.models.transformer import CausalLM
from mesp.quant import QuantSpec

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


@torch.no_grad()
def merge_into_base(model: CausalLM, quant: QuantSpec | None) -> None:
    """Fold s·BA into each adapted weight in float32, drop the adapters, then store every
    frozen weight at `quant` (None: dense in the model's dtype, the exact merged model)."""
    merge_lora(model, keep_quant=False)
    for mod in model.modules():
        if isinstance(mod, FrozenWeight) and (quant is not None or mod.quant is not None):
            mod.set_dense(mod.dense(), quant)


def model_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The frozen tensors under their HF names: the inverse of loading.build.build_model."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name in expected_tensors(model):
        mod_name, attr = name.rsplit(".", 1)
        mod = modules[mod_name]
        if isinstance(mod, FrozenWeight) and attr == "weight" and mod.quant is not None:
            out[name] = mod.weight.view(torch.uint32)  # MLX stores the words as uint32
            out[f"{mod_name}.scales"] = mod.scales
            out[f"{mod_name}.biases"] = mod.biases
        elif isinstance(mod, FrozenWeight) and attr == "weight":
            out[name] = mod.dense()
        else:
            out[name] = getattr(mod, attr)
    return {k: v.contiguous() for k, v in out.items()}


def merged_tensors(model: CausalLM) -> dict[str, LazyTensor]:
    """The tensors of the merged model, each made only when called: W + s·BA for an adapted
    linear (the module keeps its adapter), a quantized weight dequantized, anything else the
    model's own tensor. What merge_into_base + model_tensors give, without holding them all."""
    modules = dict(model.named_modules())
    out: dict[str, LazyTensor] = {}
    for name, shape in expected_tensors(model).items():
        mod_name, attr = name.rsplit(".", 1)
        mod = modules[mod_name]
        if isinstance(mod, Linear) and attr == "weight" and mod.rank:
            out[name] = (shape, lambda mod=mod: merged_weight(mod))
        elif isinstance(mod, FrozenWeight) and attr == "weight":
            out[name] = (shape, lambda mod=mod: mod.dense())
        else:
            out[name] = (shape, lambda mod=mod, attr=attr: getattr(mod, attr))
    return out


def write_model_dir(model: CausalLM, tok: Tokenizer | None, out: Path) -> None:
    """config.json last, so a directory with a config always has its weights."""
    tensors = model_tensors(model)
    cfg = model.config.to_hf()
    cfg["architectures"] = [ARCHITECTURES[model.config.family]]
    cfg["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    qpas = cfg.get("query_pre_attn_scalar")
    if isinstance(qpas, float) and qpas.is_integer():
        cfg["query_pre_attn_scalar"] = int(qpas)  # transformers' Gemma3 config wants an int
    quants = {m.quant for m in model.modules() if isinstance(m, FrozenWeight) and m.quant}
    if quants:
        q = next(iter(quants))
        cfg["quantization"] = {"group_size": q.group_size, "bits": q.bits}
    atomic_write(
        out / "model.safetensors",
        lambda p: save_file(tensors, p, metadata={"format": "pt"}),
    )
    if tok is not None:
        write_tokenizer(tok, out)
    atomic_write(out / "config.json", lambda p: Path(p).write_text(json.dumps(cfg, indent=2)))


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (specials, add_bos_token, chat template): what
    Tokenizer.from_dir and transformers read, whatever format the tokenizer came from."""

    def name(i: int | None) -> str | None:
        return None if i is None else tok.backend.id_to_token(i)

    conf = {
        "bos_token": name(tok.bos_id),
        "eos_token": name(tok.eos_id),
        "pad_token": name(tok.pad_id),
        "add_bos_token": tok.add_bos,
        "chat_template": tok.chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    conf = {k: v for k, v in conf.items() if v is not None}
    atomic_write(out / "tokenizer.json", lambda p: tok.backend.save(p))
    atomic_write(
        out / "tokenizer_config.json", lambda p: Path(p).write_text(json.dumps(conf, indent=2))
    )


@dataclass
class MergeOptions:
    adapter: str = field(default="", metadata={"help": "PEFT adapter directory", "required": True})
    out: str = field(
        default="",
        metadata={
            "help": "directory for the merged model (config.json, model.safetensors, "
            "tokenizer); with --quantize 4|8 it is written in MLX's quantized layout; a "
            "FILE.gguf: one llama.cpp GGUF file (tokenizer and chat template included)",
            "required": True,
        },
    )
    gguf_type: str = field(
        default="",
        metadata={
            "help": "tensor type of a .gguf --out: f32, f16, bf16, q8_0, q4_0, or llama.cpp's "
            "k-quant mixes q4_k_m, q5_k_m, q6_k (default: f32/f16/bf16 as --dtype; norms and "
            "biases are always f32)",
            "metavar": "TYPE",
        },
    )


def merge(opts: ModelOptions, m: MergeOptions) -> str:
    """`mesp merge`: fold the adapter into its base, write the model directory, and return the
    line that says what was written."""
    out, src = Path(m.out), Path(opts.model)
    if out.suffix == ".gguf":
        return merge_to_gguf(opts, m)
    if m.gguf_type:
        raise MespError(f"--gguf-type needs an --out ending in .gguf, got {out}")
    if src.is_dir() and out.resolve() == src.resolve():
        raise MespError(f"{out}: is the base model's directory; give a new --out")
    check_output_dir(out)
    # the base is read at full precision; --quantize applies to the merged weights
    loaded = open_model(ModelOptions(model=opts.model, quantize="none", dtype=opts.dtype))
    cfg = load_adapter(loaded.model, adapter_dir(m.adapter))
    merge_into_base(loaded.model, opts.quant)
    write_model_dir(loaded.model, loaded.tokenizer, out)
    how = f"{opts.quant.bits}-bit (MLX layout)" if opts.quant else opts.dtype
    return f"mesp: merged rank-{cfg.rank} adapter {m.adapter} into {loaded.source}; {how} in {out}"


def merge_to_gguf(opts: ModelOptions, m: MergeOptions) -> str:
    """`mesp merge … --out FILE.gguf`: the merged model as one llama.cpp GGUF file."""
    out = Path(m.out)
    gtype = m.gguf_type or DEFAULT_TYPE.get(opts.dtype, "f32")
    if gtype not in GGUF_TYPES:
        raise MespError(f"--gguf-type {gtype!r}: choose from {', '.join(GGUF_TYPES)}")
    if opts.quantize != "none":
        raise MespError("--quantize applies to model directories; a .gguf takes --gguf-type")
    if out.is_dir():
        raise MespError(f"{out}: is a directory; give a file name ending in .gguf")
    if out.exists() and Path(opts.model).exists() and out.resolve() == Path(opts.model).resolve():
        raise MespError(f"{out}: is the base model's file; give a new --out")
    check_output_dir(out.parent)
    # merged in float32 whatever --dtype says: the file's type decides the precision
    loaded = open_model(ModelOptions(model=opts.model, quantize="none", dtype="float32"))
    if loaded.model.config.family not in GGUF_ARCHS:  # no writer yet
        raise MespError(f"a merged GGUF of a {loaded.model.config.family} model is not supported")
    cfg = load_adapter(loaded.model, adapter_dir(m.adapter))
    vocab = vocab_kvs(loaded, loaded.model.config.vocab_size)  # fail before the merge
    name = Path(loaded.source).stem if Path(loaded.source).suffix else Path(loaded.source).name
    # each weight is merged (and quantized) only as the file reaches it
    write_model_gguf(loaded.model.config, merged_tensors(loaded.model), vocab, out, gtype, name)
    return (
        f"mesp: merged rank-{cfg.rank} adapter {m.adapter} into {loaded.source}; {gtype} GGUF {out}"
    )
