"""`mesp export` and `mesp run-artifacts` around the programs (the programs themselves, trained
against the engine on every family: tests/test_ondevice_et.py and tests/test_native_runner.py).

One on-device format: `--target torch` (the .pt2 programs and their libtorch runner) is refused
in one line; `--memory-report` prints the engine's measured step beside the .pte plan, whose
arenas are the ones the native runner allocates; `import mesp.runner` (the Python driver) loads
no model code and imports only torch, safetensors, executorch, gguf and its light mesp modules.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mesp.cli import main
from mesp.ondevice import et_driver, runner
from mesp.ondevice.export import ExportOptions
from mesp.ondevice.report import memory_lines, memory_report
from tests.et_cases import B, S
from tests.export_cases import _rows, _write_jsonl

pytest.importorskip("executorch")


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_target_torch_is_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    argv = ["export", "--model", "random:qwen2.5-0.5b", "--out", "/nonexistent/x"]
    assert main([*argv, "--target", "torch"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--target torch is gone" in err, err


def test_memory_report_reads_the_pte_plan(et_cases, runner_bin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The plan side, each figure from the export's own files: the embedding/head file plus the
    largest block file; the LoRA tensors plus one block's gradients; the arenas, which are the
    ones the native runner allocates (its own count, from ExecuTorch's MethodMeta), plus one
    checkpoint per block. The engine side is its measured step (whole-model gradients)."""
    case = et_cases("qwen2", "q4")
    case.reset()
    fig = memory_report(case.model, case.dir, ExportOptions(S, B, case.vchunk))
    plan, engine, conf = fig["plan"], fig["engine"], case.conf
    edge = _nbytes(load_file(case.dir / "embedding.safetensors"))
    edge += _nbytes(load_file(case.dir / "head.safetensors"))
    one_block = max(_nbytes(load_file(case.dir / b["file"])) for b in conf["blocks"])
    assert plan["weights"] == edge + one_block
    lora = [p for p in case.model.lora_parameters()]
    assert plan["lora"] == sum(p.numel() * 4 for p in lora)
    per_block = sum(p.numel() * 4 for p in case.model.layers[0].parameters() if p.requires_grad)
    assert plan["grads"] == per_block  # the tiny model's blocks are alike
    cfg = case.model.config
    assert plan["checkpoints"] == 4 * cfg.num_hidden_layers * B * S * cfg.hidden_size
    assert plan["total"] == plan["weights"] + plan["adapter"] + plan["working"]
    assert engine["total"] == engine["weights"] + engine["adapter"] + engine["working"]
    assert engine["adapter"] == 2 * plan["lora"] > plan["adapter"]  # whole-model grads held
    assert engine["weights"] > plan["weights"]
    for p in lora:
        assert p.grad is None

    data, out = _write_jsonl(tmp_path / "rows.jsonl", _rows(2)), tmp_path / "a"
    argv = [str(runner_bin), str(case.dir), "--data", str(data), "--steps", "1", "--out", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    native = float(re.search(r"planned memory ([0-9.]+) MiB", r.stdout).group(1))  # type: ignore[union-attr]
    assert native == round(plan["arena"] / 2**20, 1), (native, plan["arena"])

    lines = memory_lines(fig)
    assert lines[1].split() == ["weights", "adapter", "working", "total"]
    assert lines[2].startswith("in-process mesp") and lines[3].startswith(".pte plan")
    assert "one block" in lines[4] and "planned arenas" in lines[5] and "not planned" in lines[6]


def test_the_driver_loads_no_model_code() -> None:
    code = (
        "import sys, mesp.runner\n"
        "bad = [m for m in sys.modules if m.startswith(('mesp.models', 'mesp.nn', 'mesp.ops',"
        " 'mesp.patch'))]\n"
        "assert not bad, bad\n"
        "import mesp\n"
        "assert callable(mesp.patch) and callable(mesp.unpatch)\n"
        "import mesp.patch\n"
        "assert callable(mesp.patch), 'the submodule replaced the function'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_driver_imports_only_torch_safetensors_executorch_and_its_contract() -> None:
    """The Python driver of the on-device programs runs without mesp's model code: its
    modules import one another, two leaves (errors, DP's accountant) and a short list of
    third-party packages."""
    import mesp.accountant
    import mesp.errors
    from mesp.ondevice import adapter_gguf, contract, kernels, private, run_files

    seen: set[str] = set()
    mods = (runner, run_files, et_driver, contract, kernels, adapter_gguf, private)
    for mod in (*mods, mesp.accountant):
        tree = ast.parse(Path(mod.__file__).read_text())
        seen |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for n in ast.walk(tree):  # `from mesp.ondevice import private` names the submodule
            if isinstance(n, ast.ImportFrom) and n.module:
                subs = {f"{n.module}.{a.name}" for a in n.names}
                seen |= {m for m in subs if m in sys.modules} or {n.module}
    ours = {m for m in seen if m.split(".")[0] == "mesp"}
    assert ours == {
        "mesp.ondevice.runner",
        "mesp.ondevice.contract",
        "mesp.ondevice.kernels",
        "mesp.ondevice.adapter_gguf",
        "mesp.ondevice.private",
        "mesp.ondevice.run_files",
        "mesp.accountant",
        "mesp.errors",
    }
    leaf = ast.parse(Path(mesp.errors.__file__).read_text())
    assert not [n for n in ast.walk(leaf) if isinstance(n, ast.Import | ast.ImportFrom)]
    third_party = {m.split(".")[0] for m in seen - ours} - set(sys.stdlib_module_names)
    # gguf (gguf-py, llama.cpp's own writer): the adapter as llama.cpp's LoRA file;
    # numpy (torch's companion): DP's counter-based generator in uint64;
    # dp_accounting: DP-SGD's accountant, imported only when a run asks for DP
    assert third_party == {"torch", "safetensors", "executorch", "gguf", "numpy", "dp_accounting"}


@pytest.mark.slow
def test_cli_export_then_run_artifacts(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`mesp train` a tiny HF directory, `mesp export` it with that adapter and
    `--memory-report`, then `mesp run-artifacts` (the Python driver) and `python -m
    mesp.runner` on what it wrote: the same losses, a PEFT adapter of the exported rank."""
    from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

    model = make_model_dir(tmp_path / "hf")
    ad, art = tmp_path / "ad", tmp_path / "art"
    flags = dict(steps=1, seq_len=8, quantize="4", eval_every=0, rank=2)
    assert main(train_argv(model, make_jsonl(tmp_path / "t.jsonl", 4), ad, **flags)) == 0
    capsys.readouterr()
    argv = ["export", "--model", str(model), "--adapter", str(ad), "--out", str(art)]
    argv += "--quantize 4 --group-size 32 --seq-len 8 --memory-report".split()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    # quiet: no warning of a kind Python shows a user by default (torch's pytree printed dozens)
    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    shown = {str(w.message)[:80] for w in caught if not issubclass(w.category, hidden)}
    assert not shown, shown
    printed = capsys.readouterr().out
    assert "ExecuTorch programs (xnnpack" in printed and ".pte plan" in printed, printed
    rows = [([i % 300 for i in range(k, k + 9)], [1] * 9) for k in range(3)]
    data, out = _write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "adapter"
    argv = ["run-artifacts", str(art), "--data", str(data), "--steps", "2", "--out", str(out)]
    assert main(argv) == 0
    cli = [ln.split()[3] for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert (out / "adapter_model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
    r = subprocess.run(
        [sys.executable, "-m", "mesp.runner", str(art), "--data", str(data), "--steps", "2"]
        + ["--out", str(tmp_path / "again")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [ln.split()[3] for ln in r.stdout.splitlines() if ln.startswith("step")] == cli
