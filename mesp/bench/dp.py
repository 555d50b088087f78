"""`mesp bench dp`: a DP-SGD step's exact peak and tokens/s beside an SFT step on the same rows,
for mesp (per-layer and flat clipping) and for HF + PEFT + Opacus, in one process.

Issue 38 item 6. Every variant trains the same batch of `batch` rows of `seq` positions with
SGD; the DP variants clip each row's gradient to C = 1, add noise of σ = 1 (a seeded draw) and
divide by the batch (a fixed batch here, not a Poisson sample: the step's cost, not the
sampling, is measured). mesp's DP is its engine wrapped in PrivateEngine (clipping inside the
structured backward, mesp/engines/clipping.py); the baseline is what users run today: HF + PEFT
wrapped in Opacus's GradSampleModule (per-sample gradients of every LoRA linear kept for the
whole batch) and its DPOptimizer (flat clipping, noise), no gradient checkpointing (Opacus's
per-sample hooks do not take it).

Each variant is built (random weights at the named shape; mesp's base is table 1's, 4-bit g64;
the baseline's dense, as in table 1), warmed up, its peak measured by the exact tracker on one
step, then timed in rounds with the order rotated, so the ratios come from steps seconds apart.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from mesp.bench.inprocess import Built, side_by_side
from mesp.bench.output import write_row
from mesp.errors import MespError

Row = dict[str, Any]
VARIANTS = ("mesp-sft", "mesp-dp-layer", "mesp-dp-flat", "peft-opacus")
# the targets against mesp SFT: per-layer peak and time, flat time
TARGETS = {"layer_peak": 1.10, "layer_time": 1.2, "flat_time": 1.25}
CLIP, SIGMA = 1.0, 1.0


def _mesp(c: Any, dtype: torch.dtype, clipping: str | None) -> Built:
    """table 1's mesp model and engine, SGD; DP: the engine in PrivateEngine, then the noise and
    the division by the batch (training/privacy.py's DPSGD.privatize)."""
    from mesp.bench.variants import _engine_opts, model_config, random_batch
    from mesp.engines import make_engine
    from mesp.engines.private import PrivateEngine
    from mesp.loading import random_model
    from mesp.lora import LoraConfig, apply_lora
    from mesp.memory.tracker import adapter_tensors
    from mesp.quant import QuantSpec
    from mesp.training.privacy import DPSGD
    from mesp.training.schedule import make_optimizer

    quant = QuantSpec(c.bits, c.group_size) if c.bits else None
    model = random_model(model_config(c), quant, dtype, seed=c.seed)
    apply_lora(model, LoraConfig(rank=c.rank), seed=c.seed)
    engine: Any = make_engine("mesp", **_engine_opts(c))
    batch = random_batch(c)
    dp = None
    if clipping is not None:
        engine = PrivateEngine(engine, CLIP, clipping)
        dp = DPSGD(CLIP, SIGMA, 1.0, 1e-5, clipping, float(c.batch), c.seed)
    params = model.lora_parameters()
    opt = make_optimizer(params, "sgd", 1e-4, 0.0)
    calls = [0]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = engine.step(model, batch, batch.n_tokens)
        if dp is not None:
            calls[0] += 1
            dp.privatize(params, calls[0])
        opt.step()
        return loss

    return step, list(model.buffers()), lambda: adapter_tensors(params, opt)


def _opacus(c: Any, dtype: torch.dtype) -> Built:
    """HF Qwen2 + PEFT LoRA in Opacus's GradSampleModule + DPOptimizer (flat clip C, noise σ,
    expected batch = the batch), each row's loss its mean token cross-entropy, batch mean."""
    import transformers as tf
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from mesp.bench.variants import random_batch, shape_dict
    from mesp.memory.tracker import adapter_tensors
    from mesp.models.transformer import LORA_TARGETS

    d = shape_dict(c.shape)
    if d.pop("model_type") != "qwen2":
        raise MespError("dp: the Opacus baseline is built for qwen2 shapes only")
    torch.manual_seed(c.seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(**d), dtype=dtype)
    lcfg = PeftLoraConfig(
        r=c.rank, lora_alpha=2 * c.rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    peft = get_peft_model(hf, lcfg).train()
    model = GradSampleModule(peft)
    # Opacus's hooks on modules whose inputs need no gradient: expected here (the base is frozen)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    sgd = torch.optim.SGD(params, lr=1e-4)
    opt = DPOptimizer(sgd, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=c.batch)
    batch = random_batch(c)
    tgt = torch.where(batch.mask, batch.targets, -100)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=batch.input_ids, use_cache=False).logits
        rows = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), tgt.flatten(), reduction="none"
        ).view(tgt.shape)
        del logits
        loss = (rows.sum(1) / batch.mask.sum(1)).mean()
        loss.backward()
        opt.step()
        return float(loss.item())

    def adapter() -> list:  # the per-sample gradients Opacus keeps count as the adapter's
        extra = [p.grad_sample for p in params if getattr(p, "grad_sample", None) is not None]
        return adapter_tensors(params, sgd) + extra

    return step, frozen, adapter


def run_dp(
    out: Path, shape: str, seq: int, rank: int, dtype: str, rounds: int, warmup: int,
    command: str, variants: tuple[str, ...] = VARIANTS, batch: int = 4,
) -> list[Row]:  # fmt: skip
    """Build the variants, warm each up, track one step of each, time `rounds` rounds; one row
    under OUT/rows/dp/."""
    from mesp.bench.method import machine
    from mesp.bench.tables import VARIANTS as TABLE1
    from mesp.bench.variants import ChildConfig

    if rounds < 1 or warmup < 0:
        raise MespError("dp: --steps (rounds) must be >= 1 and --warmup >= 0")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "mesp-sft" not in variants:
        raise MespError(f"dp: variants are {', '.join(VARIANTS)}; mesp-sft needed")
    tdtype = getattr(torch, dtype)
    steps: dict[str, Built] = {}
    for v in variants:
        base = "mesp" if v.startswith("mesp") else "peft-gc"
        c = ChildConfig(variant=base, shape=shape, seq=seq, batch=batch, rank=rank, dtype=dtype,
                        **TABLE1[base])  # fmt: skip
        if base == "mesp":
            clipping = {"mesp-sft": None, "mesp-dp-layer": "per-layer"}.get(v, "flat")
            steps[v] = _mesp(c, tdtype, clipping)
        else:
            steps[v] = _opacus(c, tdtype)
    tokens = batch * seq
    per = side_by_side(steps, warmup, rounds, tokens)
    names = list(steps)
    sft = per["mesp-sft"]
    ratios: dict[str, float] = {}
    for v, p in per.items():
        if v != "mesp-sft":
            ratios[f"{v}_peak"] = p["peak_bytes"] / sft["peak_bytes"]
            ratios[f"{v}_time"] = p["median_s"] / sft["median_s"]
    checks = {
        "layer_peak": ratios.get("mesp-dp-layer_peak"),
        "layer_time": ratios.get("mesp-dp-layer_time"),
        "flat_time": ratios.get("mesp-dp-flat_time"),
    }
    meets = {k: v <= TARGETS[k] for k, v in checks.items() if v is not None}
    row: Row = {
        "table": "dp",
        "status": "ok",
        "command": command,
        "config": {"shape": shape, "seq": seq, "batch": batch, "rank": rank, "dtype": dtype,
                   "rounds": rounds, "warmup": warmup, "variants": names, "clip": CLIP,
                   "sigma": SIGMA, "threads": torch.get_num_threads()},
        "cpu": machine(),
        "variants": per,
        "over_sft": ratios,
        "targets": TARGETS,
        "meets": meets,
        "load_after": os.getloadavg()[0],
    }  # fmt: skip
    name = f"{shape}_s{seq}_b{batch}_r{rank}_{dtype}_{'+'.join(names)}.json"
    return [write_row(out / "rows" / "dp" / name, row, line, "dp")]


def line(r: Row) -> str:
    c, mib = r["config"], 2**20
    parts = [
        f"{n} peak {v['peak_bytes'] / mib:.1f} MiB, {v['tokens_per_s']:.3g} tok/s"
        for n, v in r["variants"].items()
    ]
    met = ", ".join(f"{k} {'meets' if ok else 'misses'}" for k, ok in r["meets"].items())
    return f"{c['shape']} s{c['seq']}x{c['batch']} r{c['rank']}: " + "; ".join(parts) + f" ({met})"


def section(rows: list[Row]) -> list[str]:
    ok = [r for r in rows if r.get("table") == "dp" and r.get("status") == "ok"]
    if not ok:
        return []
    lines = [
        "## DP-SGD beside SFT (`mesp bench dp`)",
        "",
        "The same fixed batch for every variant, SGD; DP clips each row's gradient to C = 1, adds "
        "noise of σ = 1 and divides by the batch. Exact peak by the live-tensor tracker on one "
        "step (Opacus's per-sample gradients counted with the adapter); tokens/s the median over "
        "rounds run side by side in one process. HF + PEFT + Opacus: GradSampleModule + "
        "DPOptimizer (flat clipping), no gradient checkpointing. Targets (issue 38): per-layer "
        "peak ≤ 1.10× and time ≤ 1.2× mesp SFT, flat time ≤ 1.25×.",
        "",
    ]
    mib = 2**20
    for r in ok:
        c, x = r["config"], r["over_sft"]
        lines += [
            f"`{r['command']}` — {c['shape']}, seq {c['seq']}, batch {c['batch']}, rank "
            f"{c['rank']}, {c['dtype']}, {c['rounds']} rounds, {c['threads']} threads; {r['cpu']}.",
            "",
            "| variant | exact peak MiB | over weights MiB | tokens/s | peak / SFT | time / SFT |",
            "|---|---|---|---|---|---|",
        ]
        for n, v in r["variants"].items():
            pk, tm = x.get(f"{n}_peak"), x.get(f"{n}_time")
            rel = f"{pk:.3f} | {tm:.3f}" if pk is not None and tm is not None else "1 | 1"
            lines.append(
                f"| {n} | {v['peak_bytes'] / mib:.1f} | {v['over_weights_bytes'] / mib:.1f} | "
                f"{v['tokens_per_s']:.3g} | {rel} |"
            )
        met = ", ".join(f"{k} {'meets' if ok else 'misses'}" for k, ok in r["meets"].items())
        lines += ["", f"Targets: {met}.", ""]
    return lines


__all__ = ["TARGETS", "VARIANTS", "line", "run_dp", "section"]
