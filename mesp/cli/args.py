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


def _tuple_arg(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()
) -> None:
    """One flag per field: `--field-name` (or metadata "flag"), dest = the field name, the
    field's help with its default; metadata may also give "choices", "metavar", "required" and
    "hidden" (accepted, not in --help)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        tp = _base_type(hints[f.name])
        help_ = meta.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kw: dict[str, Any] = {"dest": f.name}
        if meta.get("required"):
            kw["required"] = True
        else:
            kw["default"] = default
        if tp is bool:
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                help=f"{help_} (default: {'on' if default else 'off'})",
                **kw,
            )
            continue
        if tp is tuple:
            shown = ",".join(default) if default else "none"
            kw.update(type=_tuple_arg, help=f"{help_} (comma-separated; default: {shown})")
        else:
            shown = "" if meta.get("required") else f" (default: {default})"
            kw.update(type=tp, help=f"{help_}{shown}", choices=meta.get("choices"))
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        if meta.get("hidden"):
            kw["help"] = argparse.SUPPRESS
        group.add_argument(flag, **kw)


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
    """Values from --config become defaults, so explicit flags still win. Keys are flag names
    (`data`, `seq-len`, `seq_len`); each value goes through the flag's own type and choices."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    ns, _ = pre.parse_known_args(argv)
    if not ns.config:
        return
    values = load_config_file(ns.config)
    by_key: dict[str, argparse.Action] = {}
    for a in parser._actions:
        for opt in a.option_strings:
            if opt.startswith("--") and not opt.startswith("--no-"):
                by_key[opt[2:].replace("-", "_")] = a
    defaults = {}
    for k, v in values.items():
        action = by_key.get(k)
        if action is None or k in ("config", "help"):
            raise MespError(f"{ns.config}: unknown option {k!r}")
        defaults[action.dest] = _config_value(ns.config, k, v, action)
    parser.set_defaults(**defaults)


def _config_value(src: str, key: str, v: Any, action: argparse.Action) -> Any:
    """A config file's value as the flag would parse it; one-line error otherwise."""
    bad = MespError(f"{src}: {key}: invalid value {v!r}")
    if action.nargs == 0:  # on/off flags
        if not isinstance(v, bool):
            raise MespError(f"{src}: {key}: expected true or false, got {v!r}")
        return v
    if isinstance(v, dict):
        raise bad
    if isinstance(v, list):
        if action.type is not _tuple_arg or not all(isinstance(x, str) for x in v):
            raise bad
        v = ",".join(v)
    if v is None or isinstance(v, bool):
        raise bad
    try:
        out = action.type(str(v)) if callable(action.type) else str(v)
    except (ValueError, TypeError, MespError):
        raise bad from None
    if action.choices is not None and out not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise MespError(f"{src}: {key}: {v!r} is not one of {choices}")
    return out
