"""Sampling with a KV cache: greedy, temperature, top-p, repetition penalty."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from mesp.errors import MespError
from mesp.loading.session import ModelOptions, open_with_adapter
from mesp.models.linear import FrozenWeight, int4_decoding
from mesp.models.transformer import CausalLM, KVCache


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
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "divide the scores of tokens already in the prompt or output by this "
            "(CTRL's rule: >1 makes repeats less likely; 1 = off)"
        },
    )
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    decode_kernel: str = field(
        default="auto",
        metadata={
            "help": "4-bit weights at one token a step: int4 = torch's int4 CPU kernel on a "
            "packed copy (bf16 activations), dequantize = the training path's dequantize + "
            "matmul, auto = int4 where the weight is 4-bit on the CPU (int4: refuse a model "
            "without such weights)",
            "choices": ("auto", "int4", "dequantize"),
        },
    )


def generate_text(opts: ModelOptions, g: GenerateOptions) -> str:
    """`mesp generate`: the model (+ adapter) continues the prompt; the new text is returned."""
    if not g.prompt:
        raise MespError("--prompt is empty; give the text to continue")
    if not 0.0 < g.top_p <= 1.0:
        raise MespError(f"--top-p must be in (0, 1], got {g.top_p}")
    if not g.temperature >= 0.0:
        raise MespError(f"--temperature must be >= 0 (0 = greedy), got {g.temperature}")
    if not g.repetition_penalty > 0.0:
        raise MespError(f"--repetition-penalty must be > 0 (1 = off), got {g.repetition_penalty}")
    if g.max_tokens < 1:
        raise MespError(f"--max-tokens must be at least 1, got {g.max_tokens}")
    loaded = open_with_adapter(opts, g.adapter)
    if g.decode_kernel == "int4" and not _has_int4_weights(loaded.model):
        raise MespError(
            "--decode-kernel int4 needs 4-bit weights on the CPU, and this model has none "
            "(load it with --quantize 4, or use --decode-kernel auto)"
        )
    tok = loaded.require_tokenizer()
    text = g.prompt
    if g.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], True)
    ids = tok.encode(text)
    limit = loaded.model.config.max_position_embeddings
    room = limit - len(ids)
    if room < 1:
        raise MespError(
            f"the prompt is {len(ids)} tokens; the model takes at most {limit} positions"
        )
    if g.max_tokens > room:
        print(
            f"mesp: note: stopping after {room} tokens, at the model's {limit} positions",
            file=sys.stderr,
        )
    n = min(g.max_tokens, room)
    out = generate(
        loaded.model,
        ids,
        n,
        g.temperature,
        g.top_p,
        tok.stop_ids,
        g.seed,
        g.repetition_penalty,
        int4=g.decode_kernel != "dequantize",
    )
    return tok.decode(out)


def _has_int4_weights(model: torch.nn.Module) -> bool:
    """Whether any base weight is one the int4 kernel can serve."""
    return any(isinstance(m, FrozenWeight) and m.int4_capable() for m in model.modules())


@torch.no_grad()
def generate(
    model: CausalLM,
    prompt_ids: list[int],
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: set[int] | None = None,
    seed: int = 0,
    repetition_penalty: float = 1.0,
    int4: bool = True,
) -> list[int]:
    """New token ids after the prompt. temperature 0 = greedy; the repetition penalty applies
    before either (as in HF's generate). With `int4`, 4-bit CPU weights decode through torch's
    int4 kernel (a packed copy for the call; the prompt's prefill still dequantizes)."""
    with int4_decoding(model, int4):
        return _generate(
            model, prompt_ids, max_tokens, temperature, top_p, stop_ids, seed, repetition_penalty
        )


def _generate(
    model: CausalLM,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: set[int] | None,
    seed: int,
    repetition_penalty: float,
) -> list[int]:
    model.eval()
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(k=[None] * len(model.layers), v=[None] * len(model.layers))
    dev = model.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    logits = model(ids, cache=cache, start=0)[0, -1]
    out: list[int] = []
    pos = len(prompt_ids)
    seen = set(prompt_ids)
    for _ in range(max_tokens):
        scores = penalize(logits.float().cpu(), seen, repetition_penalty)
        nxt = _sample(scores, temperature, top_p, g)
        seen.add(nxt)
        if stop_ids and nxt in stop_ids:
            break
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=dev), cache=cache, start=pos)[0, -1]
        pos += 1
    return out


def penalize(logits: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019; HF's RepetitionPenaltyLogitsProcessor):
    the logit of each token already seen is divided by `penalty` when positive and multiplied
    when negative, so a penalty above 1 lowers a repeat's odds whatever its sign."""
    if penalty == 1.0 or not seen:
        return logits
    idx = torch.tensor(sorted(seen), dtype=torch.long)
    picked = logits[idx]
    out = logits.clone()
    out[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def _sample(logits: torch.Tensor, temperature: float, top_p: float, g: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p
        p, idx = probs.sort(descending=True)
        keep = p.cumsum(0) - p < top_p
        keep[0] = True  # the most likely token always stays (top_p -> 0 is greedy)
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=g))
