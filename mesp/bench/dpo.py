"""`mesp bench dpo`: a DPO step's exact peak and tokens/s beside an SFT step on the same tokens,
for mesp and for HF + PEFT + gradient checkpointing, in one process.

Issue 30 item 6. One preference pair is two sequences (chosen, rejected) of `seq` positions, so
DPO's step is set against SFT's at batch 2: the same tokens per step. The claim measured: mesp's
DPO adds no tape (the reference and policy log-probs are forwards without one, then SFT's step
with per-token weights), so its peak stays within TARGET of SFT's. The baseline runs the same
DPO loss written over HF + PEFT logits as TRL computes it: the reference pass under PEFT's
`disable_adapter()` without grad, then the policy's summed completion log-probs with autograd.

Every variant is built in this process (random weights at the named shape; mesp's base is
table 1's, 4-bit g64, the baseline's dense, as in table 1), warmed up, its peak measured by the
exact tracker on one step, then timed in rounds with the order rotated (as `mesp bench speed`),
so the tokens/s ratios are taken between steps seconds apart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mesp.bench.inprocess import Built, side_by_side
from mesp.bench.output import write_row
from mesp.errors import MespError

Row = dict[str, Any]
TARGET = 1.15  # mesp DPO peak / mesp SFT peak at the same tokens per step (issue 30 item 6)
BETA = 0.1  # TRL's default; neither the peak nor the time depends on it
VARIANTS = ("mesp-sft", "mesp-dpo", "peft-gc-sft", "peft-gc-dpo")


def _mesp(c: Any, dtype: torch.dtype, dpo: bool) -> Built:
    """mesp's model and engine as table 1 builds them (mesp.bench.variants), SGD; for DPO the
    engine wrapped in PreferenceEngine: one micro-batch, so the normalizer is 1 (pair mean)."""
    from mesp.bench.variants import _engine_opts, model_config, random_batch
    from mesp.engines import make_engine
    from mesp.engines.objective import Objective, PreferenceEngine
    from mesp.loading import random_model
    from mesp.lora import LoraConfig, apply_lora
    from mesp.memory.tracker import adapter_tensors
    from mesp.quant import QuantSpec
    from mesp.training.schedule import make_optimizer

    quant = QuantSpec(c.bits, c.group_size) if c.bits else None
    model = random_model(model_config(c), quant, dtype, seed=c.seed)
    apply_lora(model, LoraConfig(rank=c.rank), seed=c.seed)
    engine: Any = make_engine("mesp", **_engine_opts(c))
    if dpo:
        engine = PreferenceEngine(engine, Objective("dpo", beta=BETA))
    params = model.lora_parameters()
    opt = make_optimizer(params, "sgd", 1e-4, 0.0)
    batch = random_batch(c)
    norm = 1 if dpo else batch.n_tokens

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = engine.step(model, batch, norm)
        opt.step()
        return loss

    return step, list(model.buffers()), lambda: adapter_tensors(params, opt)


def _completion_logps(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):  # type: ignore[no-untyped-def]
    """(B,) summed log-probabilities of the mask tokens, as TRL's get_batch_logps."""
    lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    return (lp * mask).sum(-1)


def _peft(c: Any, dtype: torch.dtype, dpo: bool) -> Built:
    """HF + PEFT + gradient checkpointing (mesp.bench.variants.peft_setup); DPO: TRL's sigmoid
    loss over its logits, the reference with the adapter disabled and no grad."""
    from mesp.bench.tracking import Fp32Matmul
    from mesp.bench.variants import peft_setup, random_batch
    from mesp.memory.tracker import adapter_tensors
    from mesp.ops import matmul as matmul_ops

    batch = random_batch(c)
    sft, frozen, params, (opt, _, _) = peft_setup(c, dtype, batch)
    model = sft.model  # type: ignore[attr-defined]
    mask = batch.mask.float()

    def dpo_step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.no_grad(), model.disable_adapter():
            ref_logits = model(input_ids=batch.input_ids, use_cache=False).logits
            ref = _completion_logps(ref_logits, batch.targets, mask)
            del ref_logits
        logits = model(input_ids=batch.input_ids, use_cache=False).logits
        lp = _completion_logps(logits, batch.targets, mask)
        del logits
        margin = (lp[0::2] - lp[1::2]) - (ref[0::2] - ref[1::2])
        loss = -F.logsigmoid(BETA * margin).mean()
        loss.backward()
        opt.step()
        return float(loss.item())

    step = dpo_step if dpo else sft
    if matmul_ops.computes_in_fp32(torch.empty(0, dtype=dtype)):
        inner = step

        def step() -> float:  # its bf16 matmuls on the fp32 GEMM, as table 1's child runs it
            with Fp32Matmul():
                return inner()

    return step, frozen, lambda: adapter_tensors(params, opt)


def _planned(shape: str, seq: int, rank: int, dtype: str, objective: str) -> int:
    """The memory model's peak (mesp.memory.model) for mesp's step here: 2 rows, SGD, the
    4-bit g64 base of table 1."""
    from mesp.bench.variants import ChildConfig, model_config
    from mesp.memory.model import predict
    from mesp.quant import QuantSpec

    cfg = model_config(ChildConfig(variant="mesp", engine="mesp", shape=shape))
    p = predict(cfg, "mesp", seq, 2, rank, quant=QuantSpec(4, 64), dtype=getattr(torch, dtype),
                optimizer="sgd", objective=objective)  # fmt: skip
    return int(p["total"])


def run_dpo(
    out: Path, shape: str, seq: int, rank: int, dtype: str, rounds: int, warmup: int,
    command: str, variants: tuple[str, ...] = VARIANTS,
) -> list[Row]:  # fmt: skip
    """Build the variants, warm each up, track one step of each, time `rounds` rounds; one row
    under OUT/rows/dpo/."""
    from mesp.bench.method import machine
    from mesp.bench.tables import VARIANTS as TABLE1
    from mesp.bench.variants import ChildConfig

    if rounds < 1 or warmup < 0:
        raise MespError("dpo: --steps (rounds) must be >= 1 and --warmup >= 0")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not {"mesp-sft", "mesp-dpo"} <= set(variants):
        raise MespError(f"dpo: variants are {', '.join(VARIANTS)}; mesp-sft and mesp-dpo needed")
    tdtype = getattr(torch, dtype)
    steps: dict[str, Built] = {}
    for v in variants:  # one pair (2 rows) for DPO, batch 2 for SFT: the same tokens
        base = "mesp" if v.startswith("mesp") else "peft-gc"
        c = ChildConfig(variant=base, shape=shape, seq=seq, batch=2, rank=rank, dtype=dtype,
                        **TABLE1[base])  # fmt: skip
        build = _mesp if base == "mesp" else _peft
        steps[v] = build(c, tdtype, v.endswith("dpo"))
    tokens = 2 * seq
    per = side_by_side(steps, warmup, rounds, tokens)
    names = list(steps)
    for v in ("mesp-sft", "mesp-dpo"):  # what `mesp plan` predicts for this very step
        per[v]["planned_bytes"] = _planned(shape, seq, rank, dtype, v.removeprefix("mesp-"))
    ratio = per["mesp-dpo"]["peak_bytes"] / per["mesp-sft"]["peak_bytes"]
    row: Row = {
        "table": "dpo",
        "status": "ok",
        "command": command,
        "config": {"shape": shape, "seq": seq, "pairs": 1, "tokens_per_step": tokens,
                   "rank": rank, "dtype": dtype, "rounds": rounds, "warmup": warmup,
                   "variants": names, "threads": torch.get_num_threads(), "beta": BETA},
        "cpu": machine(),
        "variants": per,
        "dpo_over_sft_peak": ratio,
        "target": TARGET,
        "meets_target": ratio <= TARGET,
        "load_after": os.getloadavg()[0],
    }  # fmt: skip
    if "peft-gc-dpo" in per:
        row["peft_dpo_over_mesp_dpo_peak"] = (
            per["peft-gc-dpo"]["peak_bytes"] / per["mesp-dpo"]["peak_bytes"]
        )
    name = f"{shape}_s{seq}_r{rank}_{dtype}_{'+'.join(names)}.json"
    return [write_row(out / "rows" / "dpo" / name, row, line, "dpo")]


def line(r: Row) -> str:
    c, mib = r["config"], 2**20
    parts = [
        f"{n} peak {v['peak_bytes'] / mib:.1f} MiB, {v['tokens_per_s']:.3g} tok/s"
        for n, v in r["variants"].items()
    ]
    ok = "meets" if r["meets_target"] else "misses"
    return (
        f"{c['shape']} s{c['seq']}x2 r{c['rank']}: " + "; ".join(parts)
        + f"; mesp DPO/SFT peak {r['dpo_over_sft_peak']:.3f} ({ok} ≤ {r['target']})"
    )  # fmt: skip


def section(rows: list[Row]) -> list[str]:
    ok = [r for r in rows if r.get("table") == "dpo" and r.get("status") == "ok"]
    if not ok:
        return []
    lines = [
        "## DPO beside SFT (`mesp bench dpo`)",
        "",
        "One preference pair (chosen + rejected, 2 sequences) per DPO step against SFT at batch "
        "2: the same tokens per step. Exact peak by the live-tensor tracker on one step; tokens/s "
        "the median over rounds run side by side in one process. HF + PEFT + gradient "
        "checkpointing runs TRL's sigmoid DPO loss over its logits, the reference under "
        "`disable_adapter()` without grad.",
        "",
    ]
    mib = 2**20
    for r in ok:
        c = r["config"]
        lines += [
            f"`{r['command']}` — {c['shape']}, seq {c['seq']} per sequence, rank {c['rank']}, "
            f"{c['dtype']}, {c['rounds']} rounds, {c['threads']} threads; {r['cpu']}.",
            "",
            "| variant | exact peak MiB | over weights MiB | `mesp plan` MiB | tokens/s |",
            "|---|---|---|---|---|",
        ]
        for n, v in r["variants"].items():
            planned = f"{v['planned_bytes'] / mib:.1f}" if "planned_bytes" in v else "–"
            lines.append(
                f"| {n} | {v['peak_bytes'] / mib:.1f} | {v['over_weights_bytes'] / mib:.1f} | "
                f"{planned} | {v['tokens_per_s']:.3g} |"
            )
        verdict = "meets" if r["meets_target"] else "misses"
        lines += [
            "",
            f"mesp DPO / SFT peak: **{r['dpo_over_sft_peak']:.3f}x** ({verdict} the ≤ "
            f"{r['target']}x target).",
            "",
        ]
    return lines


__all__ = ["TARGET", "VARIANTS", "line", "run_dpo", "section"]
