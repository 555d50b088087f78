"""Every `mesp …` command in README.md and docs/ parses with the CLI's own parser.

A typo, a renamed or removed flag, or a choice that no longer exists in a documented command
fails here, so the pages a newcomer copies from cannot drift from the CLI. Commands are taken
from fenced code blocks (bash / sh / shell / console / unlabelled), joined over backslash
continuations, cut at a shell operator or comment, and split as the shell would; shell variables
stay as literal words (`$OUT` parses as a value), `…` (the other flags) is dropped and an optional
`[--flag X]` is parsed as given. Only parsing runs: nothing is loaded or trained.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from mesp.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
OPERATORS = ("|", "&&", "||", ";", ">", "2>", "<")


def _commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command text) of each `mesp …` line in the page's shell code blocks."""
    out: list[tuple[int, str]] = []
    in_block, shell, pending, start = False, False, "", 0
    for n, raw in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^\s*```\s*(\w*)", raw)
        if fence:
            in_block, shell = not in_block, fence.group(1).lower() in SHELL_BLOCKS
            continue
        if not (in_block and shell):
            continue
        line = raw.strip()
        if pending:
            pending += " " + line
        elif re.match(r"^(\$ )?mesp [a-z-]", line):  # not a table row that starts "mesp  294.7"
            pending, start = line.removeprefix("$ "), n
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        out.append((start, pending))
        pending = ""
    return out


def _argv(command: str) -> list[str]:
    command = re.sub(r"\[(--[^\]]*)\]", r"\1", command)  # "[--adapter DIR]": parse it too
    lex = shlex.shlex(command, posix=True, punctuation_chars=False)
    lex.whitespace_split, lex.commenters = True, "#"
    words = list(lex)
    for i, w in enumerate(words):
        if w in OPERATORS or w.startswith(("2>", ">")):
            words = words[:i]
            break
    # "…" stands for "the other flags as above": a placeholder, not an argument
    return [w for w in words[1:] if w not in ("…", "...")]  # [1:]: "mesp" itself


CASES = [
    pytest.param(cmd, id=f"{page.relative_to(ROOT)}:{n}")
    for page in PAGES
    for n, cmd in _commands(page)
]


def test_the_pages_have_commands() -> None:
    """The scan finds the README's quick start (so an empty CASES cannot pass by accident)."""
    readme = [c for n, c in _commands(ROOT / "README.md")]
    assert len(readme) >= 5, readme
    assert any(c.startswith("mesp train ") for c in readme)


@pytest.mark.parametrize("command", CASES)
def test_documented_command_parses(command: str) -> None:
    argv = _argv(command)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _parser().parse_args(argv)
    except SystemExit as e:  # argparse's way of saying no (or --help's yes, code 0)
        assert e.code == 0, f"{command}\n{err.getvalue().strip().splitlines()[-1:]}"
