"""`mesp export` + `mesp.runner`: the model-free runner trains exactly as the in-process engine.

On a tiny model of each family: 20 SGD steps from the artifacts give the engine's losses and its
final adapter; a runner copied out of the package trains in a process where `import mesp` fails;
bad artifacts are one line and exit code 2 with no adapter written; the runner's peak working
memory is within RUNNER_WORKING of the engine's, with at most one block's frozen weights
resident; the programs
hold no pickle and no weight; `import mesp.runner` loads no model code.
Exporting and loading programs takes seconds each, so artifacts are shared per module.
"""

from __future__ import annotations

import gc
import io
import json
import shutil
import subprocess
import sys
import sysconfig
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mesp.batch import Example, collate
from mesp.engines import make_engine
from mesp.lora import load_adapter
from mesp.memory.tracker import LiveTensorTracker, adapter_tensors
from mesp.ondevice import runner
from mesp.ondevice.export import ExportOptions, export_model
from mesp.quant import QuantSpec
from tests.engine_cases import model_with_adapter

S, B, STEPS, LR, VOCAB = 12, 2, 20, 0.05, 211
CASES = {  # family -> (base quantization, loss vocabulary slice: None = whole head)
    "qwen2": (QuantSpec(4, 32), None),  # the paper's family: 4-bit, tied head, q/k/v bias
    "llama": (None, None),
    "qwen3": (None, 64),  # q/k norms; the head in vocabulary slices (online logsumexp)
    "gemma3": (QuantSpec(4, 32), 64),  # sandwich norms, sliding-window mask (window 5 < S)
    "mistral": (None, None),  # the sliding-window mask on every layer (window 5 < S)
    "smollm3": (None, 64),  # a NoPE layer with the window; the head in slices
    "granite": (QuantSpec(4, 32), None),  # the four scalars (logits ÷ s before the head)
    "olmo2": (None, 64),  # post norms, no input norm, q/k norms over the whole projection
    "gemma2": (QuantSpec(4, 32), None),  # attention and final soft-caps, sliding/global
    "phi3": (None, 64),  # fused qkv / gate_up, partial rotary, LongRoPE, a window on every layer
}
SLOW = {
    "llama", "qwen3", "gemma3", "mistral", "smollm3", "granite", "olmo2", "gemma2", "phi3"
}  # fmt: skip  # (not qwen2)


# The loss bound is 1e-6, relative for OLMo 2: the exported SiLU backward is written out
# (mesp.ops.mlp.gated_act_backward under export: ExecuTorch has no fused kernel), an ulp or so
# from ATen's fused one, and OLMo 2's norm on the MLP output divides the gradient by that
# output's RMS (small at random weights), so those ulps move its 20 steps' losses by 1.5e-6 of
# 5.4 (measured; 0.0 with the engine on the written-out form too).
LOSS_REL = {"olmo2"}


# The runner's working memory over the engine's, at most. The exported programs are functional:
# a block backward returns fresh LoRA gradients (the engine adds into .grad in place), and the
# loss head unpacks a 4-bit vocabulary slice with traced ops and their temporaries (the engine's
# native dequantizer has none). Since the engine's LoRA forward adds in one GEMM (add_product),
# that leaves the runner at 1.05x the engine (tiny qwen2 here; 64.6 / 61.5 MiB at 0.5B).
RUNNER_WORKING = 1.1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """On a shared 2-core machine OpenMP spin-waits make these tiny ops ~30x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rows(n: int = 5, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """Rows of S + 1 tokens with a 4-token untrained prompt."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (S + 1,), generator=g).tolist(), [0] * 4 + [1] * (S - 3))
        for _ in range(n)
    ]


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write_jsonl(path: Path, rows: list[tuple[list[int], list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"input_ids": i, "loss_mask": m}) + "\n" for i, m in rows))
    return path


class _Case:
    def __init__(self, family: str, root: Path) -> None:
        quant, vchunk = CASES[family]
        self.family, self.vchunk = family, vchunk or 8192
        self.model = model_with_adapter(family, quant)
        self.init = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.dir = root / f"art_{family}"
        export_model(self.model, self.dir, ExportOptions(S, B, self.vchunk))
        self.art = runner.Artifacts(self.dir)

    def reset(self) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.init[n])


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root, made = tmp_path_factory.mktemp("export"), {}

    def get(family: str) -> _Case:
        if family not in made:
            made[family] = _Case(family, root)
        return made[family]

    return get


def _engine_run(case: _Case, rows, steps: int, adamw_lr: float | None = None) -> list[float]:  # type: ignore[no-untyped-def]
    """The reference: the in-process mesp engine and torch SGD (or AdamW without weight decay,
    the runner's default), batches in the runner's order."""
    case.reset()
    eng = make_engine("mesp", vocab_chunk=case.vchunk)
    params = case.model.lora_parameters()
    if adamw_lr is None:
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=LR)
    else:
        opt = torch.optim.AdamW(params, lr=adamw_lr, weight_decay=0.0)
    losses = []
    for k in range(steps):
        picked = [rows[(k * B + j) % len(rows)] for j in range(B)]
        batch = collate([Example(ids, mask) for ids, mask in picked])
        n = batch.n_tokens
        losses.append(eng.step(case.model, batch, n) / n)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in CASES]
)
def test_runner_trains_like_the_engine(cases, family: str) -> None:  # type: ignore[no-untyped-def]
    case, rows = cases(family), _rows()
    trainer, losses = runner.train(case.art, rows, runner.RunConfig(STEPS, LR))
    ref = _engine_run(case, rows, STEPS)
    # the loss program returns fp32 row losses; the runner sums them in fp64, as the engine does
    tol = 1e-6 * (max(map(abs, ref)) if family in LOSS_REL else 1.0)
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= tol, (losses, ref)
    assert losses[-1] < losses[0]  # it learned something
    params = dict(case.model.named_parameters())
    for i, lora in enumerate(trainer.lora):
        for k, p in lora.items():
            torch.testing.assert_close(p, params[f"model.layers.{i}.{k}"], rtol=0, atol=1e-6)
    # Frozen weights resident: embedding + final norm (+ untied head) + one block, never two.
    one_block = max(_nbytes(load_file(case.dir / b["file"])) for b in case.art.conf["blocks"])
    edge = _nbytes(case.art.embed_w) + _nbytes(case.art.head_w)
    assert case.art.peak_resident_bytes == edge + one_block


def test_runner_adamw_trains_like_the_engine(cases) -> None:  # type: ignore[no-untyped-def]
    case, rows, lr = cases("qwen2"), _rows(), 2e-3
    trainer, losses = runner.train(case.art, rows, runner.RunConfig(STEPS, lr, "adamw"))
    ref = _engine_run(case, rows, STEPS, adamw_lr=lr)
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= 1e-6, (losses, ref)
    assert losses[-1] < losses[0]
    params = dict(case.model.named_parameters())
    for i, lora in enumerate(trainer.lora):
        for k, p in lora.items():
            torch.testing.assert_close(p, params[f"model.layers.{i}.{k}"], rtol=0, atol=1e-6)


def test_runner_runs_without_the_mesp_package(cases, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A copy of runner.py, python -S (no site, so no editable-install hook), a clean cwd and a
    sys.path of that copy + site-packages only: `import mesp` must fail, training must not."""
    case, rows = cases("qwen2"), _rows()
    solo, cwd = tmp_path / "solo", tmp_path / "cwd"
    solo.mkdir()
    cwd.mkdir()
    shutil.copy(Path(runner.__file__), solo / "runner.py")
    data, out = _write_jsonl(tmp_path / "train.jsonl", rows), tmp_path / "adapter"
    boot = (
        "import sys\n"
        "try:\n    import mesp\nexcept ImportError:\n    pass\n"
        "else:\n    sys.exit('mesp is importable')\n"
        "import runner\n"
        "rc = runner.main(sys.argv[1:])\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'mesp'], 'mesp was imported'\n"
        "sys.exit(rc)\n"
    )
    site = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": f"{solo}:{site}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    argv = [str(case.dir), "--data", str(data), "--steps", "3", "--lr", str(LR), "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-S", "-c", boot, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    printed = [float(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("step")]
    ref = _engine_run(case, rows, 3)
    assert max(abs(a - b) for a, b in zip(printed, ref, strict=True)) <= 1e-6
    # The adapter is PEFT-format; attached to a fresh model it holds the engine's weights.
    fresh = model_with_adapter("qwen2", CASES["qwen2"][0])
    load_adapter(fresh, out)
    want = dict(case.model.named_parameters())
    for n, p in fresh.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=0, atol=1e-6)
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"]


def _pickle_in(data: bytes, where: str) -> list[str]:
    """Members of a zip (recursively) that are or hold a pickle."""
    found = []
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            name, blob = f"{where}!{info.filename}", z.read(info)
            if info.filename.endswith(".pkl") or blob[:1] == b"\x80" and blob[1:2] in b"\2\3\4\5":
                found.append(name)
            elif blob[:2] == b"PK":
                found += [name] + _pickle_in(blob, name)  # a torch.save file is a zip
    return found


@pytest.mark.parametrize("family", ["qwen2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_programs_hold_no_pickle_and_no_weights(cases, family: str) -> None:  # type: ignore[no-untyped-def]
    """Every .pt2 is its graph as JSON: no pickle member, no example inputs (they held the
    weights it was traced with), no stored weight or constant; the runner checks the same."""
    case = cases(family)
    progs = sorted((case.dir / "fns").glob("*.pt2"))
    assert len(progs) >= 5
    for p in progs:
        assert _pickle_in(p.read_bytes(), p.name) == []
        with zipfile.ZipFile(p) as z:
            for info in z.infolist():
                if "/data/" in info.filename:  # weights/constants configs, empty sample inputs
                    assert info.filename.endswith("_config.json") or info.file_size == 0, info
                    if info.file_size:
                        assert json.loads(z.read(info))["config"] == {}, info.filename
        assert runner.pickled_member(p) is None


def test_runner_refuses_a_program_with_a_pickle(cases, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A .pt2 saved the torch.export default way (example inputs as a torch.save pickle) is
    refused before torch.export.load could unpickle it."""
    case = cases("qwen2")
    d = Path(shutil.copytree(case.dir, tmp_path / "pickled"))
    p = d / "fns/embed.pt2"
    with zipfile.ZipFile(p) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    buf = io.BytesIO()
    torch.save(((torch.ones(3),), {}), buf)
    members[next(n for n in members if n.endswith("sample_inputs/model.pt"))] = buf.getvalue()
    with zipfile.ZipFile(p, "w") as z:
        for n, blob in members.items():
            z.writestr(n, blob)
    assert "torch.save archive" in (runner.pickled_member(p) or "")
    art = runner.Artifacts(d)
    with pytest.raises(runner.RunnerError, match="embed.pt2: refused"):
        art.load_programs()


def _live_cpu_bytes() -> int:
    """Bytes of every distinct CPU storage that a live Python tensor holds (fake tensors of the
    graphs' metadata hold none)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated torch module attributes
        for o in gc.get_objects():
            if type(o) is torch.Tensor or type(o) is torch.nn.Parameter:
                if o.device.type == "cpu" and not isinstance(o, FakeTensor):
                    st = o.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_loaded_programs_hold_no_weights(cases) -> None:  # type: ignore[no-untyped-def]
    """Loading every program adds at most one block + embedding/head of live tensors (it used to
    add the example inputs: every program's traced weights, the embedding twice)."""
    case = cases("qwen2")
    art = runner.Artifacts(case.dir)
    before = _live_cpu_bytes()
    art.load_programs()
    grown = _live_cpu_bytes() - before
    one_block = max(_nbytes(load_file(case.dir / b["file"])) for b in art.conf["blocks"])
    assert grown <= _nbytes(art.embed_w) + _nbytes(art.head_w) + one_block, grown
    assert grown < one_block  # in fact: no weight at all


def test_importing_the_runner_loads_no_model_code() -> None:
    code = (
        "import sys, mesp.runner\n"
        "bad = [m for m in sys.modules if m.startswith(('mesp.models', 'mesp.nn', 'mesp.patch'))]\n"
        "assert not bad, bad\n"
        "import mesp\n"
        "assert callable(mesp.patch) and callable(mesp.unpatch)\n"
        "import mesp.patch\n"
        "assert callable(mesp.patch), 'the submodule replaced the function'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_runner_imports_only_torch_safetensors_and_stdlib() -> None:
    import ast

    tree = ast.parse(Path(runner.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    third_party = {m.split(".")[0] for m in names} - set(sys.stdlib_module_names)
    assert third_party == {"torch", "safetensors"}, third_party


def _fails(argv: list[str], capsys, name: str, out: Path) -> None:  # type: ignore[no-untyped-def]
    assert runner.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err, err
    assert not out.exists()  # no partial adapter


def test_bad_artifacts_one_line_exit_2(cases, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    case = cases("qwen2")
    data, out = _write_jsonl(tmp_path / "d.jsonl", _rows(2)), tmp_path / "adapter"

    def copy(name: str) -> Path:
        return Path(shutil.copytree(case.dir, tmp_path / name))

    def argv(d: Path, data: Path = data) -> list[str]:
        return [str(d), "--data", str(data), "--steps", "2", "--out", str(out)]

    d = copy("missing")
    (d / "blocks/block_001.safetensors").unlink()
    _fails(argv(d), capsys, "block_001.safetensors", out)

    d = copy("shapes")  # right export id, a tensor of the wrong shape
    p = d / "blocks/block_000.safetensors"
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata()
    w = load_file(p)
    w["input_layernorm.weight"] = torch.ones(5)
    save_file(w, str(p), metadata=meta)
    _fails(argv(d), capsys, "block_000.safetensors", out)

    d = copy("mixed")  # the config of an export for another sequence length (ids differ)
    conf = json.loads((d / "run_config.json").read_text())
    conf.update(seq_len=S + 2, export_id="0" * 32)
    (d / "run_config.json").write_text(json.dumps(conf))
    _fails(argv(d), capsys, "safetensors", out)  # names the first file it checks

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 99999]}\n')
    _fails(argv(case.dir, bad), capsys, f"{bad}:2", out)
    _fails(argv(tmp_path / "nowhere"), capsys, "nowhere", out)


def test_runner_peak_working_memory_at_most_the_engines(cases) -> None:  # type: ignore[no-untyped-def]
    """Exact live-tensor accounting of one warm step each: weights / adapter / working."""
    case, rows = cases("qwen2"), _rows()
    batch = collate([Example(i, m) for i, m in rows[:B]])

    case.reset()
    eng, model = make_engine("mesp", vocab_chunk=case.vchunk), case.model
    eng.step(model, batch, batch.n_tokens)  # warm-up: grads exist, as in training
    tr = LiveTensorTracker()
    tr.register(model.buffers(), "weights")
    tr.register(adapter_tensors(model.lora_parameters()), "adapter")
    with tr:
        eng.step(model, batch, batch.n_tokens)
    ref = tr.breakdown()

    trk = LiveTensorTracker()
    art = case.art  # programs already loaded
    art.on_load = lambda w: trk.register(w.values(), "weights")
    trk.register([*art.embed_w.values(), *art.head_w.values()], "weights")
    trainer = runner.Trainer(art, load_file(case.dir / "lora_init.safetensors"))
    ids, tgt, mask = runner.make_batch(rows[:B], B, S)
    trainer.step(ids, tgt, mask)
    trk.register(adapter_tensors(trainer.parameters()), "adapter")
    trk.reset_peak()
    try:
        with trk:
            trainer.step(ids, tgt, mask)
    finally:
        art.on_load = None
    got = trk.breakdown()
    assert got["working"] <= RUNNER_WORKING * ref["working"], (got, ref)
    one_block = max(_nbytes(load_file(case.dir / b["file"])) for b in art.conf["blocks"])
    assert got["weights"] <= _nbytes(art.embed_w) + _nbytes(art.head_w) + one_block
    assert got["weights"] < ref["weights"]


def test_memory_report_rows(cases) -> None:  # type: ignore[no-untyped-def]
    """`mesp export --memory-report` (run for Qwen2.5-0.5B in the README) on the tiny export:
    both rows, the runner's working memory within RUNNER_WORKING of the engine's, one block
    resident."""
    from mesp.ondevice.report import memory_lines, memory_report

    case = cases("qwen2")
    case.reset()
    fig = memory_report(case.model, case.dir, ExportOptions(S, B, case.vchunk))
    engine, ran = fig["engine"], fig["runner"]
    assert ran["working"] <= RUNNER_WORKING * engine["working"], fig
    assert ran["weights"] < engine["weights"] and ran["adapter"] == engine["adapter"], fig
    one_block = max(_nbytes(load_file(case.dir / b["file"])) for b in case.art.conf["blocks"])
    assert fig["resident"] == fig["edge"] + one_block
    lines = memory_lines(fig)
    assert lines[1].split() == ["weights", "adapter", "working", "total"]
    assert lines[2].startswith("in-process mesp") and lines[3].startswith("mesp.runner")
    assert "one block" in lines[4]
    for p in case.model.lora_parameters():
        assert p.grad is None


@pytest.mark.slow
def test_cli_export_then_run_artifacts(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`mesp export` on an HF directory, then `mesp run-artifacts` on what it wrote."""
    import argparse

    from mesp.cli import export as export_cli
    from tests.tiny_dir import make_model_dir

    parser = argparse.ArgumentParser(prog="mesp")
    export_cli.add_parser(parser.add_subparsers(dest="cmd", required=True))
    model, art = make_model_dir(tmp_path / "hf"), tmp_path / "art"
    flags = "--quantize 4 --group-size 32 --seq-len 8 --rank 2".split()
    ns = parser.parse_args(["export", "--model", str(model), "--out", str(art), *flags])
    assert export_cli.run(ns) == 0
    assert "export id" in capsys.readouterr().out
    rows = [([i % 300 for i in range(k, k + 9)], [1] * 9) for k in range(3)]
    data, out = _write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "adapter"
    argv = ["run-artifacts", str(art), "--data", str(data), "--steps", "2", "--out", str(out)]
    assert export_cli.run(parser.parse_args(argv)) == 0
    assert (out / "adapter_model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
