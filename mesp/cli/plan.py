"""`mesp plan` (will it fit? the analytic memory model) and `mesp analyze-grads` (MeZO's
gradient estimates against the exact gradient). `add_parser` registers both; each sets
`ns.run`, a function of the parsed namespace returning the exit code."""

from __future__ import annotations

import argparse
import json

from mesp.cli.args import add_dataclass_args, from_args
from mesp.errors import MespError
from mesp.loading.session import DTYPES, ModelOptions


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = subparsers.add_parser("plan", help="predicted peak memory per engine; what fits a budget")
    s.add_argument("--memory", default="8GB", help="budget, e.g. 500MB, 8GB, 1.5GiB")
    s.add_argument(
        "--model",
        default="qwen2.5-0.5b",
        help="a named shape (qwen2.5-0.5b, llama-3.2-1b, …), config.json, model dir or .gguf",
    )
    s.add_argument("--seq-len", type=int, default=256, help="positions per row")
    s.add_argument("--rank", type=int, default=8, help="LoRA rank")
    s.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="rows per micro-batch; with --objective dpo|orpo, pairs (two rows each), as in "
        "mesp train",
    )
    s.add_argument(
        "--objective",
        default="sft",
        choices=("sft", "dpo", "orpo"),
        help="the loss trained: a preference step holds two rows per pair, its token weights "
        "and log-prob buffers, and runs its log-prob passes without a tape (mezo cannot)",
    )
    s.add_argument(
        "--quantize",
        default="auto",
        choices=("auto", "none", "4", "8"),
        help="base weights (auto: a quantized GGUF's codes as stored, otherwise 4-bit)",
    )
    s.add_argument("--group-size", type=int, default=64, help="quantization group size")
    s.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="compute dtype")
    s.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    s.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    s.set_defaults(run=run_plan)

    s = subparsers.add_parser(
        "analyze-grads", help="cosine of MeZO's n-SPSA estimates with the exact gradient"
    )
    add_dataclass_args(s, ModelOptions)
    s.add_argument(
        "--data",
        default=None,
        help="data (default: Shakespeare; random tokens "
        "for random:SHAPE models, which have no tokenizer)",
    )
    s.add_argument("--batches", type=int, default=4, help="batches K to average over")
    s.add_argument("--seq-len", type=int, default=128)
    s.add_argument("--batch-size", type=int, default=1)
    s.add_argument("--rank", type=int, default=8)
    s.add_argument("--samples", default="1,4,16,64", help="n values for n-SPSA (comma list)")
    s.add_argument("--eps", type=float, default=1e-2, help="SPSA perturbation scale")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--directional",
        action="store_true",
        help="take each probe's g as zᵀ∇ from the exact gradient (ε → 0; no forwards)",
    )
    s.add_argument("--out", default="grad_analysis", help="directory for the JSON and PNG")
    s.add_argument(
        "--convergence",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: train mesp and mezo STEPS steps each from the same start on --data and "
        "write valid loss against steps and seconds (convergence.json / .png)",
    )
    s.add_argument("--lr", type=float, default=1e-3, help="convergence: mesp's AdamW lr")
    s.add_argument(
        "--zo-lr", type=float, default=1e-4, help="convergence: mezo's SGD lr (MeZO paper)"
    )
    s.add_argument("--eval-batches", type=int, default=4, help="convergence: valid batches")
    s.set_defaults(run=run_analyze_grads)


def _positive(ns: argparse.Namespace, *names: str) -> None:
    for n in names:
        if getattr(ns, n) <= 0:
            raise MespError(f"--{n.replace('_', '-')} must be positive, got {getattr(ns, n)}")


def run_plan(ns: argparse.Namespace) -> int:
    from mesp.loading.info import stored_weight_bytes
    from mesp.memory.plan import Run, format_plan, model_config, parse_bytes, plan
    from mesp.quant import QuantSpec

    _positive(ns, "seq_len", "rank", "batch_size")
    budget = parse_bytes(ns.memory)
    cfg, name = model_config(ns.model)
    bits = 4 if ns.quantize == "auto" else 0 if ns.quantize == "none" else int(ns.quantize)
    quant = QuantSpec(bits, ns.group_size) if bits else None
    opts = ModelOptions(model=ns.model, quantize=ns.quantize, dtype=ns.dtype)
    run = Run(
        ns.seq_len,
        ns.batch_size * (1 if ns.objective == "sft" else 2),  # a pair is two rows
        ns.rank,
        quant=quant,
        dtype=DTYPES[ns.dtype],
        optimizer=ns.optimizer,
        weights=stored_weight_bytes(opts, cfg),  # a GGUF's codes as stored: their exact bytes
        objective=ns.objective,
    )
    result = plan(budget, cfg, name, run)
    print(json.dumps(result) if ns.json else format_plan(result))
    return 0


def run_analyze_grads(ns: argparse.Namespace) -> int:
    from mesp.bench.grads import GradStudy, run_analysis

    _positive(ns, "batches", "seq_len", "batch_size", "rank")
    study, opts = from_args(GradStudy, ns), from_args(ModelOptions, ns)
    study.sample_counts()  # a bad --samples fails before any work
    if not study.convergence:
        print(run_analysis(opts, study))
        return 0
    from mesp.bench.convergence import run_convergence

    _positive(ns, "convergence", "seq_len", "batch_size", "rank", "eval_batches")
    for line in run_convergence(opts, study):
        print(line)
    return 0
