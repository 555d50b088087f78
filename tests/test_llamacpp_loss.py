"""llama.cpp itself reads what mesp writes and computes mesp's loss: a tiny llama with grouped-query
attention (3 query heads over 1 KV head, so llama's q/k row permutation matters) written as an f32
GGUF by `mesp merge`, exported, trained a few steps by the native runner, whose adapter.gguf
llama.cpp applies (scripts/llamacpp-loss, against libllama built once under ~/.cache/mesp/llamacpp).
Base and adapted, llama.cpp's mean next-token loss is `mesp eval --json`'s within 1e-4 relative
(measured here: 2.5e-6 and 4.3e-7), and the adapter moves it by far more than that."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mesp.cli import main
from tests.test_merge import _adapter
from tests.tiny_dir import VOCAB, make_model_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ROWS, S, REL = 5, 32, 1e-4
LLAMACPP = Path.home() / ".cache" / "mesp" / "llamacpp"


def _missing(why: str) -> None:
    """Skip when llama.cpp cannot be built here; fail where it must run (CI, scripts/test-slow)."""
    if os.environ.get("MESP_REQUIRE_REAL") == "1" or os.environ.get("CI") == "true":
        pytest.fail(f"{why} (MESP_REQUIRE_REAL=1 or CI=true)")
    pytest.skip(why)


def _env() -> dict[str, str]:
    """The venv's bin first on PATH: its python3 (with pip) and any cmake / ninja it holds."""
    return {**os.environ, "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def _buildable() -> None:
    """libllama is built, or cmake, ninja and a C compiler are here to build it."""
    env = _env()
    top = LLAMACPP / env.get("VERSION", "0.3.36")
    if any(top.glob("build-*/bin/libllama.so")):
        return
    for tool in ("cmake", "ninja", "cc"):
        if shutil.which(tool, path=env["PATH"]) is None:
            _missing(f"no {tool} to build llama.cpp's library (scripts/llamacpp-loss)")


def _llamacpp(*args: Path) -> float:
    """scripts/llamacpp-loss: llama.cpp's mean next-token loss (building libllama once)."""
    env = _env()
    cmd = [str(ROOT / "scripts" / "llamacpp-loss"), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, f"llamacpp-loss failed:\n{r.stdout}\n{r.stderr}"
    return float(json.loads(r.stdout.splitlines()[-1])["loss"])


def _mesp_eval(capsys: pytest.CaptureFixture[str], base: Path, rows: Path, *extra: str) -> float:
    capsys.readouterr()
    argv = ["eval", "--model", str(base), "--quantize", "none", "--data", str(rows), "--json"]
    assert main([*argv, "--seq-len", str(S), *extra]) == 0
    return float(json.loads(capsys.readouterr().out.splitlines()[-1])["loss"])


def test_llamacpp_computes_mesps_loss_with_the_runners_adapter_gguf(
    runner_bin: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("executorch")
    _buildable()  # before minutes of work
    # 1. the base: a random rank-2 adapter merged into a tiny GQA llama, written as an f32 GGUF
    hf = make_model_dir(tmp_path / "hf", "llama")  # 3 query heads over 1 KV head (tests.hf_tiny)
    _adapter(hf, tmp_path / "merge_ad")
    base = tmp_path / "base.gguf"
    argv = ["merge", "--model", str(hf), "--adapter", str(tmp_path / "merge_ad")]
    assert main([*argv, "--out", str(base), "--gguf-type", "f32"]) == 0

    # 2. rows of S + 1 random token ids, every next token scored
    g = torch.Generator().manual_seed(3)
    rows = tmp_path / "rows.jsonl"
    ids = torch.randint(0, VOCAB, (ROWS, S + 1), generator=g).tolist()
    rows.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ids))

    # 3. export (a fresh rank-4 adapter: B = 0, the base's loss until it trains), the native runner
    art, trained = tmp_path / "art", tmp_path / "adapter"
    argv = ["export", "--model", str(base), "--quantize", "none", "--seq-len", str(S)]
    assert main([*argv, "--rank", "4", "--out", str(art)]) == 0
    cmd = [str(runner_bin), str(art), "--data", str(rows), "--steps", "10", "--out", str(trained)]
    train = ["--optimizer", "adamw", "--lr", "0.02"]  # SGD at 0.02 moves the loss by only 0.2%
    r = subprocess.run([*cmd, *train], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (trained / "adapter.gguf").is_file(), r.stdout

    # 4. mesp's losses and llama.cpp's, on the same rows
    mesp_base = _mesp_eval(capsys, base, rows)
    mesp_tuned = _mesp_eval(capsys, base, rows, "--adapter", str(trained))
    cpp_base = _llamacpp(base, rows)
    cpp_tuned = _llamacpp(base, trained / "adapter.gguf", rows)
    assert cpp_base == pytest.approx(mesp_base, rel=REL)
    assert cpp_tuned == pytest.approx(mesp_tuned, rel=REL)
    # the adapter was really applied: it moves the loss by 1.3%, the tolerance's 130 times
    assert abs(cpp_tuned - cpp_base) > 20 * REL * cpp_base
