"""Flags map one to one to dataclass fields: `--seq-len` is DataConfig.seq_len, with its help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from mesp.errors import MespError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")


def _base_type(tp: Any) -> Any:
    """`int | None` -> int; `tuple[str, ...]` -> tuple."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return origin or tp


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()
) -> None:
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        help_ = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if tp is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_
            )
        elif tp is tuple:
            group.add_argument(
                flag,
                type=lambda s: tuple(x for x in s.split(",") if x),
                default=default,
                help=f"{help_} (comma-separated)",
            )
        else:
            group.add_argument(
                flag,
                type=tp,
                default=default,
                help=f"{help_} (default: {default})",
                choices=f.metadata.get("choices"),
            )


def from_args(cls: type[T], ns: argparse.Namespace, **extra: Any) -> T:
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return cls(**{**kw, **extra})


def load_config_file(path: str) -> dict[str, Any]:
    """A YAML or TOML file whose keys are flag names (dashes or underscores)."""
    p = Path(path)
    if not p.is_file():
        raise MespError(f"{p}: config file not found")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise MespError(f"{p}: config must be .yaml, .yml, .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise MespError(f"{p}: {e}") from None
    except Exception as e:  # yaml.YAMLError
        if isinstance(e, MespError):
            raise
        raise MespError(f"{p}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise MespError(f"{p}: expected a mapping of flag names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def apply_resume_defaults(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`--resume DIR`: the flags of the run saved there become defaults (explicit flags win,
    and the saved fingerprint refuses any change that would alter the result)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--resume")
    ns, _ = pre.parse_known_args(argv)
    if not ns.resume:
        return
    f = Path(ns.resume) / "run_args.json"
    if not f.is_file():
        raise MespError(f"{f}: missing; is {ns.resume} the --adapter-out of a mesp train run?")
    try:
        values = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise MespError(f"{f}: {e}") from None
    known = {a.dest for a in parser._actions}
    parser.set_defaults(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in known}
    )


def apply_config_defaults(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Values from --config become defaults, so explicit flags still win."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    ns, _ = pre.parse_known_args(argv)
    if not ns.config:
        return
    values = load_config_file(ns.config)
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise MespError(f"{ns.config}: unknown option {unknown[0]!r}")
    for k, v in values.items():
        if isinstance(v, list):
            values[k] = tuple(v)
    parser.set_defaults(**values)
