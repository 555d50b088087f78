"""`mesp info | train | eval | generate | grad | export | run-artifacts | plan | bench`: thin;
flags are dataclass fields."""

from __future__ import annotations

import argparse
import logging
import sys

from mesp.cli_args import add_dataclass_args, apply_config_defaults, apply_resume_defaults
from mesp.errors import MespError
from mesp.session import ModelOptions
from mesp.train import Interrupted


def _add_mezo_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--zo-eps", type=float, default=1e-2, help="mezo: perturbation size")
    s.add_argument("--zo-samples", type=int, default=1, help="mezo: SPSA probes per step")


def _add_offload_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--offload",
        default="none",
        choices=("none", "cpu", "disk"),
        help="mebp/mesp: keep block checkpoints in memory, host memory, or on disk",
    )
    s.add_argument("--offload-dir", default=None, help="directory for --offload disk files")
    s.add_argument(
        "--stream-weights",
        action="store_true",
        help="mesp: frozen block weights on disk (in --offload-dir), one block in memory",
    )
    s.add_argument(
        "--offload-fallback",
        action="store_true",
        help="if the offload disk fails or fills, keep checkpoints in memory",
    )


def _add_loss_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--loss",
        default="ce",
        choices=("ce", "sampled-softmax"),
        help="exact cross-entropy, or softmax over targets + a vocabulary subset (approximate)",
    )
    s.add_argument(
        "--vocab-subset",
        type=int,
        default=1000,
        metavar="K",
        help="sampled-softmax: tokens besides the targets (top K of the head at probe rows)",
    )
    s.add_argument(
        "--logits-masking",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="form logits only for trained tokens (--no-logits-masking: for every token)",
    )


def _parser() -> argparse.ArgumentParser:
    from mesp.data import DataConfig
    from mesp.engines import ENGINES
    from mesp.lora import LoraConfig
    from mesp.train import TrainConfig

    p = argparse.ArgumentParser(prog="mesp", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("info", help="architecture, sizes and LoRA parameter count of a model")
    add_dataclass_args(s, ModelOptions)
    add_dataclass_args(s, LoraConfig, skip=("scale", "alpha"))

    s = sub.add_parser("train", help="fine-tune LoRA adapters")
    s.add_argument("--config", help="YAML/TOML file of flag values (flags given here win)")
    s.add_argument("--engine", default="mesp", choices=ENGINES, help="gradient engine")
    s.add_argument(
        "--h-strategy",
        default="recompute",
        choices=("recompute", "store"),
        help="mesp: recompute LoRA's h = xAᵀ in backward, or store it (ablation)",
    )
    _add_offload_flags(s)
    _add_mezo_flags(s)
    _add_loss_flags(s)
    s.add_argument("--adapter-out", default="adapters", help="directory for the adapter + logs")
    s.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes on this machine (launches torchrun)",
    )
    s.add_argument("--master-port", type=int, default=29517, help="torchrun rendezvous port")
    s.add_argument(
        "--dist-timeout",
        type=float,
        default=120.0,
        help="seconds before surviving ranks give up on a dead one",
    )
    s.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run saved in DIR (its flags are the defaults)",
    )
    s.add_argument("--max-memory", default=None, help="memory budget, e.g. 500MB (planner)")
    s.add_argument(
        "--data",
        dest="path",
        default=None,
        help=DataConfig.__dataclass_fields__["path"].metadata["help"],
    )
    add_dataclass_args(s, ModelOptions)
    add_dataclass_args(s, DataConfig, skip=("path", "seed"))
    add_dataclass_args(s, LoraConfig)
    add_dataclass_args(s, TrainConfig)

    s = sub.add_parser("eval", help="loss / perplexity on a data set")
    add_dataclass_args(s, ModelOptions)
    s.add_argument("--adapter", default=None, help="PEFT adapter directory")
    s.add_argument("--data", dest="path", default=None, help="data (default: Shakespeare valid)")
    s.add_argument("--seq-len", type=int, default=512)
    s.add_argument("--batch-size", type=int, default=4)
    s.add_argument("--max-batches", type=int, default=0, help="0 = all")
    s.add_argument("--json", action="store_true", help="print one JSON object")

    s = sub.add_parser("generate", help="sample text (KV cache)")
    add_dataclass_args(s, ModelOptions)
    s.add_argument("--adapter", default=None)
    s.add_argument("--prompt", required=True)
    s.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="wrap the prompt in the model's chat template",
    )
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)

    s = sub.add_parser("grad", help="LoRA gradients of one batch, under PEFT key names")
    add_dataclass_args(s, ModelOptions)
    s.add_argument("--adapter", default=None, help="adapter to differentiate (default: fresh)")
    s.add_argument("--engine", default="mesp", choices=ENGINES)
    s.add_argument("--h-strategy", default="recompute", choices=("recompute", "store"))
    _add_offload_flags(s)
    _add_mezo_flags(s)
    _add_loss_flags(s)
    s.add_argument("--data", dest="path", default=None)
    s.add_argument("--seq-len", type=int, default=128)
    s.add_argument("--batch-size", type=int, default=1)
    s.add_argument("--rank", type=int, default=8)
    s.add_argument("--out", required=True, help="output .safetensors")
    _add_extensions(sub)
    return p


def _add_extensions(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Commands whose parsers live beside their code; each sets `run` on its namespace."""
    from mesp import bench_cli, export_cli, plan_cli

    plan_cli.add_parser(sub)
    bench_cli.add_parser(sub).set_defaults(run=bench_cli.run)
    export_cli.add_parser(sub)
    for name in ("export", "run-artifacts"):
        sub.choices[name].set_defaults(run=export_cli.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="mesp: warning: %(message)s")
    try:
        parser = _parser()
        if argv and argv[0] == "train":
            sub = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
            train_parser = sub.choices["train"]  # type: ignore[attr-defined]
            apply_resume_defaults(train_parser, argv[1:])
            apply_config_defaults(train_parser, argv[1:])
        ns = parser.parse_args(argv)
        ns.argv = argv
        if hasattr(ns, "run"):
            return int(ns.run(ns))
        from mesp import commands

        return getattr(commands, f"cmd_{ns.cmd}")(ns)
    except MespError as e:
        print(f"mesp: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"mesp: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("mesp: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"mesp: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
