"""`mesp export` (per-block weights + the .pte programs of a step) and `mesp run-artifacts` (the
runners that train from them: the native one, or the Python driver)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mesp.cli.args import add_dataclass_args, from_args
from mesp.errors import MespError


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from mesp.loading.session import ModelOptions
    from mesp.lora import LoraConfig
    from mesp.ondevice import runner
    from mesp.ondevice.export import ExportOptions

    s = sub.add_parser(
        "export", help="per-block weights + ExecuTorch programs for `mesp run-artifacts`"
    )
    s.add_argument("--out", required=True, help="artifact directory (must not exist or be empty)")
    s.add_argument("--adapter", default=None, help="start from this PEFT adapter (default: fresh)")
    s.add_argument("--seed", type=int, default=0, help="seed of a fresh adapter's init")
    add_dataclass_args(s, ModelOptions)
    add_dataclass_args(s, LoraConfig)
    add_dataclass_args(s, ExportOptions)
    s.add_argument(
        "--memory-report",
        action="store_true",
        help="then measure one training step of the in-process mesp engine (exact tracker) and "
        "print it beside what the exported programs' plan holds in a step",
    )

    r = sub.add_parser(
        "run-artifacts", help="train LoRA from `mesp export` artifacts (no model code)"
    )
    runner.add_arguments(r)
    r.add_argument(
        "--runtime",
        choices=("auto", "python", "native"),
        default="auto",
        help="python: the .pte programs through executorch.runtime; native: the C++ runner "
        "(scripts/build-ondevice); auto: python (default)",
    )


def run(ns: argparse.Namespace) -> int:
    if ns.cmd == "run-artifacts":
        return _run_artifacts(ns)
    if ns.cmd != "export":
        raise MespError(f"unknown command {ns.cmd!r}")
    from mesp.loading.session import ModelOptions, open_model
    from mesp.lora import LoraConfig, apply_lora, load_adapter
    from mesp.ondevice.export import ExportOptions, export_model
    from mesp.ondevice.report import memory_lines, memory_report

    opts = from_args(ExportOptions, ns)
    loaded = open_model(from_args(ModelOptions, ns), seed=ns.seed)
    if ns.adapter:
        from mesp.loading.hub import adapter_dir  # a directory, or org/name from the HF cache

        load_adapter(loaded.model, adapter_dir(ns.adapter))
    else:
        apply_lora(loaded.model, from_args(LoraConfig, ns), seed=ns.seed)
    conf = export_model(loaded.model, Path(ns.out), opts, base_name=loaded.source)
    line = f"exported {ns.out}: {len(conf['blocks'])} blocks"
    et = conf["executorch"]
    line += (
        f", {len(et['programs'])} ExecuTorch programs ({et['backend']}; largest planned "
        f"memory {et['planned_bytes_max'] / 2**20:.1f} MiB)"
    )
    print(f"{line}; export id {conf['export_id']}", flush=True)
    if ns.memory_report:
        for row in memory_lines(memory_report(loaded.model, Path(ns.out), opts, ns.seed)):
            print(row, flush=True)
    return 0


def _run_artifacts(ns: argparse.Namespace) -> int:
    from mesp.ondevice import runner

    if ns.runtime == "native":
        from mesp.ondevice import native

        return native.run(ns)
    from mesp.ondevice import et_driver

    return runner.run_cli(ns, et_driver.train)
