"""`mesp plan` (will it fit? the analytic memory model) and `mesp analyze-grads` (MeZO's
gradient estimates against the exact gradient). `add_parser` registers both; each sets
`ns.run`, a function of the parsed namespace returning the exit code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mesp.cli_args import add_dataclass_args, from_args
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
    s.add_argument("--batch-size", type=int, default=1, help="rows per micro-batch")
    s.add_argument("--quantize", default="4", choices=("none", "4", "8"), help="base weights")
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
    from mesp.memory.plan import Run, format_plan, model_config, parse_bytes, plan
    from mesp.quant import QuantSpec

    _positive(ns, "seq_len", "rank", "batch_size")
    budget = parse_bytes(ns.memory)
    cfg, name = model_config(ns.model)
    quant = None if ns.quantize == "none" else QuantSpec(int(ns.quantize), ns.group_size)
    run = Run(
        ns.seq_len,
        ns.batch_size,
        ns.rank,
        quant=quant,
        dtype=DTYPES[ns.dtype],
        optimizer=ns.optimizer,
    )
    result = plan(budget, cfg, name, run)
    print(json.dumps(result) if ns.json else format_plan(result))
    return 0


def _batches(ns: argparse.Namespace, loaded) -> list:  # type: ignore[no-untyped-def]
    from mesp.batch import Batch, collate
    from mesp.data import DataConfig, load_splits, pad_id_of

    k, b, s = ns.batches, ns.batch_size, ns.seq_len
    if loaded.tokenizer is None:  # random:SHAPE: nothing to tokenize with
        g = torch.Generator().manual_seed(ns.seed)
        v = loaded.model.config.vocab_size
        ids = torch.randint(0, v, (k, b, s + 1), generator=g)
        mask = torch.ones(b, s, dtype=torch.bool)
        return [Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous(), mask) for x in ids]
    rows = load_splits(DataConfig(path=ns.data, seq_len=s), loaded.tokenizer)["train"]
    if len(rows) < k * b:
        raise MespError(
            f"--batches {k} × --batch-size {b} needs {k * b} rows; data has {len(rows)}"
        )
    pad = pad_id_of(loaded.tokenizer)
    return [collate(rows[i * b : (i + 1) * b], pad) for i in range(k)]


def run_analyze_grads(ns: argparse.Namespace) -> int:
    from mesp.bench.grads import analyze_grads, write_analysis
    from mesp.loading.session import open_model
    from mesp.lora import LoraConfig, apply_lora

    _positive(ns, "batches", "seq_len", "batch_size", "rank")
    try:
        samples = [int(x) for x in ns.samples.split(",") if x.strip()]
    except ValueError:
        raise MespError(f"--samples must be a comma list of integers, got {ns.samples!r}") from None
    if ns.convergence:
        return _run_convergence(ns)
    loaded = open_model(from_args(ModelOptions, ns), seed=ns.seed)
    apply_lora(loaded.model, LoraConfig(rank=ns.rank), seed=ns.seed)
    batches = _batches(ns, loaded)
    result = analyze_grads(loaded.model, batches, samples, ns.eps, ns.seed, ns.directional)
    js, png = write_analysis(result, Path(ns.out))
    means = ", ".join(f"n={n}: {c:+.5f}" for n, c in result["mean_cos_by_n"].items())
    print(
        f"mesp: d = {result['dimension']:,} adapter weights; mean cosine with the exact gradient "
        f"{means} (one sample: E|cos| {result['mean_single_abs_cos']:.5f}, "
        f"isotropic theory {result['theory_single_abs_cos']:.5f}); wrote {js} and {png}"
    )
    return 0


def _run_convergence(ns: argparse.Namespace) -> int:
    """mesp (exact gradients, AdamW) against mezo (SPSA, SGD) from the same weights, adapter
    init and batch order: valid loss by step and by training second."""
    from mesp.bench.grads import convergence
    from mesp.data import DataConfig, load_splits, pad_id_of
    from mesp.loading.session import open_model
    from mesp.lora import LoraConfig, apply_lora
    from mesp.training import TrainConfig

    _positive(ns, "convergence", "seq_len", "batch_size", "rank", "eval_batches")
    opts = from_args(ModelOptions, ns)
    first = open_model(opts, seed=ns.seed)
    if first.tokenizer is None:
        raise MespError("--convergence needs a model with a tokenizer (not random:SHAPE)")
    splits = load_splits(DataConfig(path=ns.data, seq_len=ns.seq_len), first.tokenizer)
    lora = LoraConfig(rank=ns.rank)
    cache = [first]

    def make_model():  # type: ignore[no-untyped-def]
        loaded = cache.pop() if cache else open_model(opts, seed=ns.seed)
        apply_lora(loaded.model, lora, seed=ns.seed)
        return loaded.model

    every = max(1, ns.convergence // 10)
    cfg = TrainConfig(
        steps=ns.convergence,
        batch_size=ns.batch_size,
        lr=ns.lr,
        warmup=0,
        schedule="constant",
        eval_every=every,
        eval_batches=ns.eval_batches,
        save_every=ns.convergence,
        seed=ns.seed,
        progress=False,
    )
    mezo = {"lr": ns.zo_lr, "eps": ns.eps, "seed": ns.seed}
    res = convergence(
        make_model,
        splits["train"],
        splits["valid"],
        cfg,
        lora,
        Path(ns.out),
        engine_opts={"mezo": mezo},
        pad_id=pad_id_of(first.tokenizer),
    )
    for name, r in res["runs"].items():
        print(
            f"mesp: {name}: valid loss {r['valid_loss'][0]:.4f} -> {r['valid_loss'][-1]:.4f} "
            f"in {r['steps'][-1]} steps, {r['total_seconds']:.0f} s"
        )
    print(f"mesp: wrote {Path(ns.out) / 'convergence.json'} and convergence.png")
    return 0
