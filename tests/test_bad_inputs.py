"""The catalogue of bad input: each gets one line naming what is wrong, a non-zero exit, no
traceback, and no partial or corrupt output file."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from mesp.cli import main
from tests.tiny_dir import make_jsonl, make_model_dir

FAST = [
    "--quantize",
    "none",
    "--seq-len",
    "48",
    "--steps",
    "1",
    "--no-progress",
    "--eval-batches",
    "1",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    model = make_model_dir(root / "model", "qwen2")
    other = make_model_dir(root / "other", "qwen2", hidden_size=48, head_dim=16)
    good = make_jsonl(root / "good.jsonl", 12)
    out = root / "other_adapter"
    assert (
        main(
            [
                "train",
                "--model",
                str(other),
                "--data",
                str(good),
                "--adapter-out",
                str(out),
                "--rank",
                "2",
                *FAST,
            ]
        )
        == 0
    )
    return {"root": root, "model": model, "good": good, "other_adapter": out}


def _data(root: Path, name: str, content: bytes) -> str:
    p = root / name
    p.write_bytes(content)
    return str(p)


def _broken_model(root: Path, model: Path, name: str, edit) -> str:  # type: ignore[no-untyped-def]
    import shutil

    dst = root / name
    if not dst.exists():
        shutil.copytree(model, dst)
        edit(dst)
    return str(dst)


def _edit_config(**kv):  # type: ignore[no-untyped-def]
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **kv}))

    return edit


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 100])


CASES = {
    "memory_budget_too_small": (lambda e: ["--max-memory", "1MB"], "--max-memory 1MB"),
    "malformed_jsonl": (
        lambda e: ["--data", _data(e["root"], "m.jsonl", b'{"text": "a"}\n{oops\n')],
        "m.jsonl:2",
    ),
    "non_utf8": (
        lambda e: ["--data", _data(e["root"], "u.jsonl", b'{"text": "\xff\xfe"}\n')],
        "u.jsonl:1",
    ),
    "wrong_field_type": (
        lambda e: ["--data", _data(e["root"], "t.jsonl", b'{"text": 5}\n')],
        "t.jsonl:1",
    ),
    "missing_key": (
        lambda e: ["--data", _data(e["root"], "k.jsonl", b'{"body": "x"}\n')],
        "k.jsonl:1",
    ),
    "empty_dataset": (lambda e: ["--data", _data(e["root"], "e.jsonl", b"")], "e.jsonl"),
    "all_rows_too_long": (
        lambda e: [
            "--data",
            _data(e["root"], "l.jsonl", (json.dumps({"text": "word " * 400}) + "\n").encode()),
            "--overlong",
            "drop",
        ],
        "--seq-len",
    ),
    "unknown_architecture": (
        lambda e: [
            "--model",
            _broken_model(e["root"], e["model"], "falcon", _edit_config(model_type="falcon")),
        ],
        "falcon",
    ),
    "config_weights_disagree": (
        lambda e: [
            "--model",
            _broken_model(e["root"], e["model"], "wide", _edit_config(intermediate_size=200)),
        ],
        "config expects",
    ),
    "truncated_safetensors": (
        lambda e: ["--model", _broken_model(e["root"], e["model"], "trunc", _truncate)],
        "truncated",
    ),
    "truncated_gguf": (
        lambda e: ["--model", _data(e["root"], "x.gguf", b"GGUF\x03\x00\x00")],
        "x.gguf",
    ),
    "rank_zero": (lambda e: ["--rank", "0"], "--rank"),
    "stream_weights_without_mesp": (
        lambda e: ["--engine", "mebp", "--stream-weights"],
        "--stream-weights needs --engine mesp",
    ),
    "stream_weights_unwritable": (
        lambda e: ["--stream-weights", "--offload-dir", "/proc/self/nope"],
        "--stream-weights",
    ),
    "vocab_subset_over_vocab": (
        lambda e: ["--loss", "sampled-softmax", "--vocab-subset", "100000"],
        "not smaller than the vocabulary",
    ),
    "lr_negative": (lambda e: ["--lr", "-1"], "--lr"),
    "lr_nan": (lambda e: ["--lr", "nan"], "--lr"),
    "seq_len_over_max": (lambda e: ["--seq-len", "100000"], "maximum"),
    "batch_size_zero": (lambda e: ["--batch-size", "0"], "--batch-size"),
    "missing_data_file": (lambda e: ["--data", str(e["root"] / "nope.jsonl")], "nope.jsonl"),
    "output_is_a_file": (lambda e: ["--adapter-out", str(e["good"])], "not a directory"),
    "output_unwritable": (lambda e: ["--adapter-out", "/proc/self/mesp-out"], "mesp-out"),
    "unknown_target": (lambda e: ["--targets", "q_proj,zz_proj"], "zz_proj"),
    "resume_without_state": (lambda e: ["--resume", str(e["root"])], "run_args.json"),
    "bad_config_file": (
        lambda e: ["--config", _data(e["root"], "c.toml", b"no_such = 1\n")],
        "no_such",
    ),
}


# cases that fail only once training has begun, after the run's first files were written
LEAVES_OUTPUT: dict[str, str] = {}  # case -> why it may leave output (none today)


def _output_dir(argv: list[str]) -> Path:
    """Where `mesp train` writes: the --resume directory, else the last --adapter-out."""
    flag = "--resume" if "--resume" in argv else "--adapter-out"
    return Path(argv[len(argv) - 1 - argv[::-1].index(flag) + 1])


def _snapshot(p: Path) -> dict[str, tuple[int, int]] | None:
    """Every file under p (or p itself) with its size and mtime; None if p does not exist."""
    if not p.exists():
        return None
    files = [p] if not p.is_dir() else [f for f in p.rglob("*") if not f.is_dir()]
    return {str(f.relative_to(p)): (f.stat().st_size, f.stat().st_mtime_ns) for f in files}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_train_input(
    case: str, env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    extra, expect = CASES[case]
    argv = [
        "train",
        "--model",
        str(env["model"]),
        "--data",
        str(env["good"]),
        *FAST,
        "--adapter-out",
        str(tmp_path / "out"),
        *extra(env),
    ]
    out = _output_dir(argv)
    before = _snapshot(out)
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("mesp: error:") and err.count("\n") == 1, err
    assert expect in err, err
    # no output at all: not an adapter, nor run_args.json, log.jsonl, a state or temp file;
    # a directory that was there (an old run, a file in the way) is left as it was
    after = _snapshot(out)
    left = (
        (after or {}) if before is None else {k: v for k, v in after.items() if v != before.get(k)}
    )
    gone = sorted(set(before or {}) - set(after or {}))
    if (left or gone) and case in LEAVES_OUTPUT:
        pytest.xfail(LEAVES_OUTPUT[case])
    assert not left and not gone, f"{case}: wrote {sorted(left)}, removed {gone} in {out}"


def test_adapter_for_another_model(env: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    rc = main(
        [
            "eval",
            "--model",
            str(env["model"]),
            "--adapter",
            str(env["other_adapter"]),
            "--data",
            str(env["good"]),
            "--quantize",
            "none",
            "--seq-len",
            "48",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "shape" in err and err.count("\n") == 1, err


def test_disk_full_on_save_keeps_the_previous_adapter(
    env: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    argv = [
        "train",
        "--model",
        str(env["model"]),
        "--data",
        str(env["good"]),
        *FAST,
        "--adapter-out",
        str(out),
    ]
    assert main(argv) == 0
    before = (out / "adapter_model.safetensors").read_bytes()
    import mesp.lora

    def full(tensors, path, metadata=None):  # type: ignore[no-untyped-def]
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mesp.lora, "save_file", full)
    capsys.readouterr()
    assert main([*argv, "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and err.count("\n") == 1
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.startswith(".adapter")]  # no temp left


def _fstring_code(token: str) -> list[bool] | None:
    """For an f-string token (Python < 3.12 gives one token), which characters are code, i.e.
    inside {replacement fields}; None for other strings."""
    prefix = token[: len(token) - len(token.lstrip("rRbBuUfF"))]
    if "f" not in prefix.lower():
        return None
    code, depth, i = [False] * len(token), 0, len(prefix)
    while i < len(token):
        ch = token[i]
        if depth == 0 and ch in "{}" and token[i : i + 2] in ("{{", "}}"):
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
        elif depth:
            code[i] = True
        i += 1
    return code


def test_no_pickle_anywhere() -> None:
    """Tensors go through safetensors, state through JSON: no pickle, no unsafe torch.load,
    no eval/exec in the package."""
    import io
    import re
    import tokenize

    pkg = Path(__file__).resolve().parent.parent / "mesp"
    bad = []
    text = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    for f in pkg.rglob("*.py"):
        src = f.read_text()
        # each line with comments and string contents blanked out: docstrings, messages and
        # f-string text may say "pickle"; code (f-string {expressions} included) may not
        lines = [list(line) for line in src.splitlines()]
        for t in tokenize.generate_tokens(io.StringIO(src).readline):
            if t.type in text:
                keep = _fstring_code(t.string) if t.type == tokenize.STRING else None
                k = 0
                for row in range(t.start[0], t.end[0] + 1):
                    lo = t.start[1] if row == t.start[0] else 0
                    hi = t.end[1] if row == t.end[0] else len(lines[row - 1])
                    for c in range(lo, hi):
                        if keep is None or not keep[k]:
                            lines[row - 1][c] = " "
                        k += 1
                    k += 1  # the newline between rows
        code_of = {i: "".join(chars) for i, chars in enumerate(lines, 1)}
        for i, code in sorted(code_of.items()):
            if re.search(r"\bpickle\b|\bcloudpickle\b|\bdill\b", code):
                bad.append(f"{f}:{i}: pickle")
            if "torch.load(" in code and "weights_only=True" not in code:
                bad.append(f"{f}:{i}: torch.load without weights_only=True")
            if re.search(r"(?<![\w.])(eval|exec)\(", code):
                bad.append(f"{f}:{i}: eval/exec")
    assert not bad, bad
