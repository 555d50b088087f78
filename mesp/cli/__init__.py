"""`mesp info | train | eval | generate | tokenize | merge | export-adapter | grad | export |
run-artifacts | plan | bench`: flags are dataclass fields."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import NoReturn

from mesp.cli.args import add_dataclass_args, apply_config_defaults, apply_resume_defaults
from mesp.errors import MespError
from mesp.loading.session import ModelOptions
from mesp.training import Interrupted


class _Parser(argparse.ArgumentParser):
    """Bad flags in one line (argparse prints the whole usage first): which command, what is
    wrong, where the help is. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, _refusal(self.prog, message))


def _refusal(prog: str, message: str) -> str:
    return f"{prog}: error: {message} (see {prog} --help)\n"


def _parser() -> argparse.ArgumentParser:
    from mesp.convert.gguf_adapter import ExportAdapterOptions
    from mesp.convert.merge import MergeOptions
    from mesp.data import DataConfig
    from mesp.data.tokenize import TokenizeOptions
    from mesp.engines.options import EngineOptions
    from mesp.inference.generate import GenerateOptions
    from mesp.lora import LoraConfig
    from mesp.training import TrainConfig
    from mesp.training.evaluate import EvalOptions
    from mesp.training.grad import GradOptions
    from mesp.training.privacy import PrivacyConfig
    from mesp.training.run import RunOptions

    p = _Parser(prog="mesp", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name: str, help_: str, *groups: type | tuple[type, tuple[str, ...]]) -> None:
        s = sub.add_parser(name, help=help_, description=help_)
        for g in groups:
            cls, skip = g if isinstance(g, tuple) else (g, ())
            add_dataclass_args(s, cls, skip=skip)

    # One --seed per command: TrainConfig's / GradOptions' also orders the data (DataConfig.seed)
    data = (DataConfig, ("seed",))
    command(
        "info",
        "architecture, sizes and LoRA parameter count of a model",
        ModelOptions,
        (LoraConfig, ("scale", "alpha")),
    )
    sub.choices["info"].add_argument(
        "model_arg", nargs="?", metavar="MODEL", help="the model (same as --model)"
    )
    command(
        "train",
        "fine-tune LoRA adapters",
        RunOptions,
        ModelOptions,
        EngineOptions,
        data,
        LoraConfig,
        TrainConfig,
        PrivacyConfig,
    )
    # None = "not given": the engine decides (mesp.training.config.engine_defaults)
    sub.choices["train"].set_defaults(lr=None, schedule=None)
    command(
        "eval",
        "loss / perplexity on a data set (a file: all of it; a directory: its valid split)",
        ModelOptions,
        EvalOptions,
        (DataConfig, ("seed", "valid_fraction")),
    )
    command("generate", "sample text (KV cache)", ModelOptions, GenerateOptions)
    command(
        "tokenize",
        "write data as pre-tokenized rows (jsonl) for `mesp run-artifacts` and the native runner",
        ModelOptions,
        TokenizeOptions,
        (DataConfig, ("seed",)),
    )
    command(
        "merge",
        "fold an adapter into its base and write a model directory (HF, or MLX if quantized) "
        "or a llama.cpp GGUF file (--out FILE.gguf)",
        ModelOptions,
        MergeOptions,
    )
    sub.choices["merge"].set_defaults(quantize="none")  # the exact merged model by default
    command(
        "export-adapter",
        "write a PEFT adapter as a llama.cpp LoRA GGUF (llama-cli -m base.gguf --lora FILE)",
        ModelOptions,
        ExportAdapterOptions,
    )
    command(
        "grad",
        "LoRA gradients of one batch, under PEFT key names",
        ModelOptions,
        EngineOptions,
        GradOptions,
        (DataConfig, ("seed", "valid_fraction")),
        LoraConfig,
        PrivacyConfig,
    )
    _add_extensions(sub)
    return p


def _add_extensions(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Commands whose parsers live beside their code; each sets `run` on its namespace."""
    from mesp.cli import bench as bench_cli
    from mesp.cli import export as export_cli
    from mesp.cli import plan as plan_cli

    plan_cli.add_parser(sub)
    bench_cli.add_parser(sub).set_defaults(run=bench_cli.run)
    export_cli.add_parser(sub)
    for name in ("export", "run-artifacts"):
        sub.choices[name].set_defaults(run=export_cli.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="mesp: warning: %(message)s")
    # torchao (which peft and executorch import) logs every optional kernel library it cannot
    # load, and torch's pytree a deprecation for torchao's enums, on each import: nothing a
    # mesp user can act on, and under mesp's prefix they read as mesp's own warnings
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # and torch's pytree warns once per tree spec that ExecuTorch's export copies (dozens of lines
    # in `mesp export`): a third-party deprecation, not the user's to act on
    warnings.filterwarnings(
        "ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning
    )
    try:
        parser = _parser()
        if argv and argv[0] == "train":
            sub = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
            train_parser = sub.choices["train"]  # type: ignore[attr-defined]
            apply_resume_defaults(train_parser, argv[1:])
            apply_config_defaults(train_parser, argv[1:])
        ns, extra = parser.parse_known_args(argv)
        if extra:  # named by the (sub)command that does not take them
            prog = " ".join(["mesp", ns.cmd, *([ns.bench] if getattr(ns, "bench", None) else [])])
            parser.exit(2, _refusal(prog, f"unrecognized arguments: {' '.join(extra)}"))
        ns.argv = argv
        if hasattr(ns, "run"):
            return int(ns.run(ns))
        from mesp.cli import commands

        return getattr(commands, f"cmd_{ns.cmd.replace('-', '_')}")(ns)
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
