"""The core commands: each parses its flags into the dataclasses they fill and calls the one
library function that the tests call too."""

from __future__ import annotations

import argparse
import json

from mesp.cli.args import from_args
from mesp.data import DataConfig
from mesp.engines.options import EngineOptions
from mesp.loading.session import ModelOptions
from mesp.lora import LoraConfig


def cmd_info(ns: argparse.Namespace) -> int:
    from mesp.loading.info import model_info

    if ns.model_arg:  # `mesp info MODEL`
        ns.model = ns.model_arg
    print(model_info(from_args(ModelOptions, ns), rank=ns.rank, targets=ns.targets))
    return 0


def cmd_train(ns: argparse.Namespace) -> int:
    from mesp.training import TrainConfig
    from mesp.training.config import engine_defaults
    from mesp.training.privacy import PrivacyConfig
    from mesp.training.run import RunOptions, TrainJob, run

    unset = {k: v for k, v in engine_defaults(ns.engine).items() if getattr(ns, k) is None}
    job = TrainJob(
        run=from_args(RunOptions, ns),
        model=from_args(ModelOptions, ns),
        engine=from_args(EngineOptions, ns),
        data=from_args(DataConfig, ns, seed=ns.seed),
        lora=from_args(LoraConfig, ns),
        train=from_args(TrainConfig, ns, **unset),
        argv=ns.argv,
        privacy=from_args(PrivacyConfig, ns),
    )
    return run(job)


def cmd_eval(ns: argparse.Namespace) -> int:
    from mesp.training.evaluate import EvalOptions, score

    ev = from_args(EvalOptions, ns)
    res = score(from_args(ModelOptions, ns), ev, from_args(DataConfig, ns))
    if ev.json:
        print(json.dumps(res))
    else:
        print(f"loss {res['loss']:.4f}  perplexity {res['ppl']:.2f}  ({res['tokens']} tokens)")
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from mesp.inference.generate import GenerateOptions, generate_text

    print(generate_text(from_args(ModelOptions, ns), from_args(GenerateOptions, ns)))
    return 0


def cmd_tokenize(ns: argparse.Namespace) -> int:
    from mesp.data.tokenize import TokenizeOptions, write_rows

    print(
        write_rows(
            from_args(ModelOptions, ns), from_args(TokenizeOptions, ns), from_args(DataConfig, ns)
        )
    )
    return 0


def cmd_merge(ns: argparse.Namespace) -> int:
    from mesp.convert.merge import MergeOptions, merge

    print(merge(from_args(ModelOptions, ns), from_args(MergeOptions, ns)))
    return 0


def cmd_export_adapter(ns: argparse.Namespace) -> int:
    from mesp.convert.gguf_adapter import ExportAdapterOptions, export_adapter

    print(export_adapter(from_args(ModelOptions, ns), from_args(ExportAdapterOptions, ns)))
    return 0


def cmd_grad(ns: argparse.Namespace) -> int:
    from mesp.training.grad import GradOptions, grad
    from mesp.training.privacy import PrivacyConfig

    opts, g = from_args(ModelOptions, ns), from_args(GradOptions, ns)
    eng, lora = from_args(EngineOptions, ns), from_args(LoraConfig, ns)
    privacy = from_args(PrivacyConfig, ns)
    print(grad(opts, eng, g, from_args(DataConfig, ns), lora, privacy))
    return 0
