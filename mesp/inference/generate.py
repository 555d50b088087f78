"""Sampling with a KV cache: greedy, temperature, top-p."""

from __future__ import annotations

import torch

from mesp.models.transformer import CausalLM, KVCache


@torch.no_grad()
def generate(
    model: CausalLM,
    prompt_ids: list[int],
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: set[int] | None = None,
    seed: int = 0,
) -> list[int]:
    """New token ids after the prompt. temperature 0 = greedy."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(k=[None] * len(model.layers), v=[None] * len(model.layers))
    dev = model.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    logits = model(ids, cache=cache, start=0)[0, -1]
    out: list[int] = []
    pos = len(prompt_ids)
    for _ in range(max_tokens):
        nxt = _sample(logits.float().cpu(), temperature, top_p, g)
        if stop_ids and nxt in stop_ids:
            break
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=dev), cache=cache, start=pos)[0, -1]
        pos += 1
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
