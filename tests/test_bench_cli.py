"""`mesp bench <name>` (issue 39, item 2): each benchmark a subcommand with only the flags it
reads, a flag of another benchmark refused in one line, and a row's canonical command derived
from the parsed flags (defaults the benchmark resolved included), so it reproduces the run."""

from __future__ import annotations

import argparse
import shlex

import pytest

from mesp.cli import _parser, main
from mesp.cli.bench import BENCHES
from mesp.cli.bench_flags import COMMON, canonical


def _sub(name: str) -> argparse.ArgumentParser:
    bench = _parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    return bench._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def test_ondevice_help_lists_only_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ondevice", "--help"])
    text = capsys.readouterr().out
    for flag in ("--models", "--memory-cap", "--find-cap", "--checkpoints-on-disk", "--out"):
        assert flag in text
    for flag in ("--rungs", "--fraction", "--vocab-subset", "--decode-tokens", "--matmul"):
        assert flag not in text, flag


def test_every_benchmark_has_its_declared_flags_and_no_other() -> None:
    for name, b in BENCHES.items():
        want = {"--" + f.replace("_", "-") for f in (*b.flags, *COMMON)}
        assert _flags(_sub(name)) == want, name


def test_another_benchmarks_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "ondevice", "--rungs", "lora"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "mesp bench ondevice: error: unrecognized arguments: --rungs lora" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["ondevice", "--models", "qwen2.5-coder-0.5b", "--seq", "128,256", "--find-cap"],
        ["table2", "--shapes", "qwen2.5-0.5b", "--seq", "512", "--dtype", "float32"],
        ["speed", "--engines", "mesp,peft-gc", "--steps", "5", "--matmul", "fp32"],
        ["ladder", "--rungs", "lora,stream", "--fraction", "0.5", "--device", "cpu"],
        ["dequant", "--warmup", "0", "--steps", "2"],
    ],
)
def test_canonical_command_parses_back_to_the_same_flags(argv: list[str]) -> None:
    """The command a row records, parsed again, gives the same values (--out added)."""
    ns = _parser().parse_args(["bench", *argv])
    cmd = canonical(ns)
    assert cmd.startswith(f"mesp bench {argv[0]} ") and "--out bench_results" in cmd
    again = _parser().parse_args(shlex.split(cmd)[1:])
    for name in ns.bench_flags:
        assert getattr(again, name) == getattr(ns, name), name


def test_resolved_defaults_are_in_the_command() -> None:
    """A benchmark's own defaults (here ondevice's shape, seq and rank) are written out, so the
    command still reproduces the row if the defaults change."""
    ns = _parser().parse_args(["bench", "ondevice"])
    ns.shapes, ns.seq, ns.rank = ("qwen2.5-0.5b",), (256,), (8,)
    cmd = canonical(ns)
    assert "--shapes qwen2.5-0.5b --seq 256 --rank 8" in cmd
    assert "--timeout" not in cmd and "--report-only" not in cmd
