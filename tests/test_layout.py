"""The package's import graph: no circles, and imports flow down, CLI -> wings -> core.

Every import in every module counts, at module level or inside a function: a lazy import is
still a dependency. See ARCHITECTURE.md for what each folder holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mesp"
# The core: the model, its ops and engines, loading, and the few types they share.
CORE = {"models", "ops", "engines", "loading", "quant", "config", "errors", "batch", "lora"}
CORE |= {"atomic_io", "quant_pack", "accountant"}
WINGS = {"bench", "convert", "data", "inference", "memory", "nn", "ondevice", "training"}
FACADES = {"patch", "runner"}  # public names that re-export a wing
TOP = {"__init__", "__main__"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = ("mesp", *p.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The mesp modules `name` imports (a `from a import b` of a submodule b counts as a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mesp"}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against this module's package
                pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                pkg = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                base = f"{pkg}.{node.module}"
            if base.split(".")[0] != "mesp":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    found.discard(name)
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, p, mods) for n, p in mods.items()}


def _room(module: str) -> str:
    """The top-level folder or file a module belongs to: mesp.training.loop -> training."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_known_room() -> None:
    rooms = {_room(m) for m in _graph()}
    unknown = rooms - CORE - WINGS - FACADES - TOP - {"cli"}
    assert not unknown, f"new top-level modules: say in tests/test_layout.py where {unknown} sit"


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one() -> None:
    """The check above can fail: a two-module circle and a three-module one are found."""
    g = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(g) == [["a", "b"], ["c", "d", "e"]]


def test_imports_flow_down() -> None:
    bad = []
    for mod, deps in _graph().items():
        room = _room(mod)
        for dep in deps:
            to = _room(dep)
            if room in CORE and to not in CORE:
                bad.append(f"core {mod} imports {dep}")
            if to == "cli" and room not in ("cli", "__main__"):
                bad.append(f"{mod} imports the CLI ({dep})")
            if to in FACADES and room != "__init__":
                bad.append(f"{mod} imports the public re-export {dep}; import its wing")
    assert bad == []
