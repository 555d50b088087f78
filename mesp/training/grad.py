"""`mesp grad`: the LoRA gradients of one batch under PEFT key names, from any exact engine, so
engines (and other tools) can be compared tensor by tensor."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from mesp.atomic_io import atomic_write
from mesp.batch import collate
from mesp.data import DataConfig, load_splits, pad_id_of
from mesp.data.preference import collate_pairs, load_pair_splits
from mesp.engines import make_engine
from mesp.engines.options import EngineOptions, engine_kwargs
from mesp.engines.private import PrivateEngine
from mesp.engines.ref_cache import attach_ref_cache
from mesp.errors import MespError
from mesp.loading.session import ModelOptions, open_with_adapter
from mesp.lora import LoraConfig, adapter_state, apply_lora, check_output_dir
from mesp.training.privacy import DPSGD, PrivacyConfig


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
    ref_cache: str | None = field(
        default=None,
        metadata={
            "help": "dpo: read (or write) the reference log-probs per row in DIR, as mesp "
            "train --ref-cache keeps them (checked against the model)",
            "metavar": "DIR",
        },
    )


def grad(
    opts: ModelOptions,
    eng: EngineOptions,
    g: GradOptions,
    data: DataConfig,
    lora: LoraConfig,
    privacy: PrivacyConfig | None = None,
) -> str:
    """Write the gradients of the first `g.batch_size` rows to `g.out`; returns the line that
    says what was written. With DP-SGD (`privacy`): the rows' clipped per-example gradients
    summed, plus noise of std σ·C (seeded by --seed), divided by the rows: one DP-SGD step's
    gradient on this batch (no sampling, no accountant)."""
    out = Path(g.out)
    if out.is_dir():
        raise MespError(f"{out}: is a directory; give a .safetensors file path")
    if eng.engine == "mezo":
        raise MespError(
            "mesp grad: mezo computes no gradient (one projected scalar per probe); "
            "use --engine bp, mebp or mesp"
        )
    if g.adapter and g.init_b:
        raise MespError("--init-b applies to a fresh adapter; drop it or drop --adapter")
    if g.batch_size < 1:
        raise MespError(f"--batch-size must be at least 1, got {g.batch_size}")
    data, _ = data.for_scoring()
    check_output_dir(out.parent)  # fail before the work, not after
    engine = make_engine(eng.engine, **engine_kwargs(eng, opts.quantize, g.seed))
    dp = None
    if privacy is not None and privacy.on:
        if privacy.dp_noise is None or privacy.dp_clip is None:
            raise MespError("mesp grad: --dp-epsilon needs a run (mesp train); give --dp-noise")
        engine = PrivateEngine(engine, privacy.dp_clip, privacy.dp_clipping)
        d = privacy.dp_delta or 1e-5
        dp = DPSGD(privacy.dp_clip, privacy.dp_noise, 1.0, d, privacy.dp_clipping, 0.0, g.seed)
    attach_ref_cache(engine, g.ref_cache, eng.objective)
    loaded = open_with_adapter(opts, g.adapter)
    model, tok = loaded.model, loaded.tokenizer  # pre-tokenized rows need none
    data.check_positions(model.config.max_position_embeddings)
    engine.loss.check(model.config.vocab_size)  # type: ignore[attr-defined]
    if not g.adapter:
        apply_lora(model, lora, seed=g.seed)
        if g.init_b:
            gen = torch.Generator().manual_seed(g.seed + 1)
            for mod in model.lora_modules().values():
                b = torch.randn(mod.lora_B.shape, generator=gen) * g.init_b
                mod.lora_B.data.copy_(b.to(mod.lora_B.dtype))
        else:
            print(
                "mesp: note: a fresh adapter has lora_B = 0, so every lora_A gradient is 0 "
                "(give --adapter or --init-b 0.01 to compare engines on both)",
                file=sys.stderr,
            )
    pad = pad_id_of(tok, model.config)
    if getattr(engine, "objective", None) is not None:  # preference: batch_size pairs
        pairs = load_pair_splits(data, tok, model.config.vocab_size)["train"][: g.batch_size]
        batch = collate_pairs(pairs, pad).to(model.device)
        mean = engine.step(model, batch, 1)  # the batch-mean pair loss and its gradient
    else:
        rows = load_splits(data, tok, vocab_size=model.config.vocab_size)["train"][: g.batch_size]
        batch = collate(rows, pad).to(model.device)
        mean = engine.step(model, batch, batch.n_tokens) / batch.n_tokens
    params = [p for mod in model.lora_modules().values() for p in (mod.lora_A, mod.lora_B)]
    if dp is not None:  # the step returned Σ of the rows' mean losses; (Σ clipped + noise) / B
        mean = mean * batch.n_tokens / batch.mask.shape[0]
        dp.expected = float(batch.mask.shape[0])
        dp.privatize(params, 0)
    # A then B for each adapted module: adapter_state's key order
    grads = {k: p.grad.contiguous() for k, p in zip(adapter_state(model), params, strict=True)}
    meta = {
        "engine": engine.name,
        "loss": f"{mean:.8f}",
        "tokens": str(batch.n_tokens),
        **({"dp": json.dumps(dp.fingerprint())} if dp is not None else {}),
    }
    atomic_write(out, lambda p: save_file(grads, p, metadata=meta))
    return f"mesp: wrote {len(grads)} gradients (loss {mean:.4f}) to {out}"
