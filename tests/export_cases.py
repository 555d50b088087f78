"""The tiny models every on-device test exports, and the engine run they are checked against.

CASES: per family, the base quantization and the loss's vocabulary slice that its ExecuTorch
cases use (tests/et_cases.py). `mixed_model`: one block with both kinds of frozen matmul, so one
export per family checks the family's ops with a 4-bit and a dense base (tests/test_ondevice_et.py);
`_engine_run` is the reference: the in-process mesp engine with torch's SGD or AdamW, on the
rows in the drivers' order."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mesp.batch import Example, collate
from mesp.engines import make_engine
from mesp.quant import QuantSpec
from tests.engine_cases import Q4_SIZES, model_with_adapter

S, B, STEPS, LR, VOCAB = 12, 2, 20, 0.05, 211
Q4 = QuantSpec(4, 32)
CASES = {  # family -> (base quantization, loss vocabulary slice: None = whole head)
    "qwen2": (Q4, None),  # the paper's family: 4-bit, tied head, q/k/v bias
    "llama": (None, None),
    "qwen3": (None, 64),  # q/k norms; the head in vocabulary slices (online logsumexp)
    "gemma3": (Q4, 64),  # sandwich norms, sliding-window mask (window 5 < S)
    "mistral": (None, None),  # the sliding-window mask on every layer (window 5 < S)
    "smollm3": (None, 64),  # a NoPE layer with the window; the head in slices
    "granite": (Q4, None),  # the four scalars (logits ÷ s before the head)
    "olmo2": (None, 64),  # post norms, no input norm, q/k norms over the whole projection
    "gemma2": (Q4, None),  # attention and final soft-caps, sliding/global
    "phi3": (None, 64),  # fused qkv / gate_up, partial rotary, LongRoPE, a window on every layer
}


def mixed_model(family: str, **over):  # type: ignore[no-untyped-def]
    """The family's tiny model with its base precision (CASES) in the embedding, the head and the
    attention projections, and the other one (4-bit g32 or dense) in the MLP's: every block holds
    both kinds of frozen matmul. The MLP's dense weights are the 4-bit values dequantized (or the
    4-bit codes are those of the dense weights), so the model is still the seeded one."""
    base = CASES[family][0]
    m = model_with_adapter(family, base, **{**Q4_SIZES, **over})
    for name, mod in m.lora_modules().items():
        if ".mlp." in name:
            mod.set_dense(mod.dense(), None if base is not None else Q4)
    quants = {mod.quant is None for mod in m.lora_modules().values()}
    assert quants == {True, False}, (family, quants)  # both kinds in every block
    return m


def _rows(n: int = 5, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """Rows of S + 1 tokens with a 4-token untrained prompt."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (S + 1,), generator=g).tolist(), [0] * 4 + [1] * (S - 3))
        for _ in range(n)
    ]


def _write_jsonl(path: Path, rows: list[tuple[list[int], list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"input_ids": i, "loss_mask": m}) + "\n" for i, m in rows))
    return path


def _engine_run(case, rows, steps: int, adamw_lr: float | None = None) -> list[float]:  # type: ignore[no-untyped-def]
    """The reference: the in-process mesp engine and torch SGD (or AdamW without weight decay,
    the drivers' default), batches in the drivers' order. `case`: its model, vchunk, reset()."""
    case.reset()
    eng = make_engine("mesp", vocab_chunk=case.vchunk)
    params = case.model.lora_parameters()
    if adamw_lr is None:
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=LR)
    else:
        opt = torch.optim.AdamW(params, lr=adamw_lr, weight_decay=0.0)
    losses = []
    for k in range(steps):
        picked = [rows[(k * B + j) % len(rows)] for j in range(B)]
        batch = collate([Example(ids, mask) for ids, mask in picked])
        n = batch.n_tokens
        losses.append(eng.step(case.model, batch, n) / n)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


__all__ = ["B", "CASES", "LR", "S", "STEPS", "VOCAB", "mixed_model", "model_with_adapter"]
