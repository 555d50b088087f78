"""The adapter the device can use: both on-device drivers write the trained adapter as llama.cpp's
LoRA GGUF, adapter.gguf beside the PEFT files, from run_config.json's "gguf_adapter" section
(no model code at train time). It is byte for byte what `mesp export-adapter` writes from the
runner's own PEFT directory for the same base; gguf-py reads it back with llama.cpp's names,
shapes and values, llama's q/k row permutation of B included. An export with no such section
trains as before and says in one line that there is no adapter.gguf; a malformed one is refused
before any file is written."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from mesp.cli import main
from mesp.ondevice import runner
from tests.engine_cases import Q4_SIZES
from tests.hf_tiny import hf_model
from tests.test_native_runner import _conf, _copy, _edit_conf, _jsonl, _refused, _rows, _run

LEAVES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def _base_dir(family: str, quant: str, path: Path) -> Path:
    """The exported tiny model's base as an HF directory (tests.engine_cases.model_with_adapter's
    shapes, T.mixed_model's for "mixed"): export-adapter reads only its names and shapes."""
    over = Q4_SIZES if quant in ("q4", "mixed") else {}
    hf_model(family, **over).save_pretrained(str(path))
    return path


def _peft_lora(out: Path, n_layers: int) -> list[dict]:
    """The runner's PEFT file as the Python driver's trainer.lora: per block, key -> tensor."""
    from safetensors.torch import load_file as load_torch

    lora: list[dict] = [{} for _ in range(n_layers)]
    for k, t in load_torch(str(out / "adapter_model.safetensors")).items():
        i, key = k.removeprefix(f"{runner.PEFT_PREFIX}model.layers.").split(".", 1)
        lora[int(i)][key.removesuffix(".weight")] = t
    return lora


def _py_save(conf: dict, lora: list[dict], out: Path) -> str:
    return runner.save_adapter(SimpleNamespace(art=SimpleNamespace(conf=conf), lora=lora), out)


@pytest.mark.parametrize(
    "family,quant",
    [("qwen2", "q4"), pytest.param("llama", "mixed", marks=pytest.mark.slow)],
)
def test_adapter_gguf_is_what_export_adapter_writes(  # type: ignore[no-untyped-def]
    runner_bin: Path, et_cases, tmp_path: Path, family: str, quant: str
) -> None:
    case = et_cases(family, quant)
    conf = _conf(case.dir)
    out = tmp_path / "trained"
    r = _run(runner_bin, case.dir, _jsonl(tmp_path / "rows.jsonl", _rows(case.dir)), out,
             "--lr", "0.05", "--threads", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "adapter.gguf" not in r.stdout  # written: no note
    got = (out / "adapter.gguf").read_bytes()

    # (a) export-adapter on the runner's PEFT directory, for the same base: the same bytes
    ref = tmp_path / "ref.gguf"
    base = _base_dir(family, quant, tmp_path / "base")
    assert main(["export-adapter", "--model", str(base), "--adapter", str(out),
                 "--out", str(ref)]) == 0  # fmt: skip
    assert got == ref.read_bytes()
    # the Python driver's writer on the same tensors: the same bytes too
    lora = _peft_lora(out, conf["model"]["num_hidden_layers"])
    assert _py_save(conf, lora, tmp_path / "py" / "trained") == ""
    assert (tmp_path / "py" / "trained" / "adapter.gguf").read_bytes() == got

    # (b) gguf-py reads it back: llama.cpp's keys, names, shapes and the trained values
    reader = gguf.GGUFReader(out / "adapter.gguf")
    f = reader.fields
    assert f["general.architecture"].contents() == family
    assert f["general.type"].contents() == "adapter" and f["adapter.type"].contents() == "lora"
    assert f["general.name"].contents() == "trained"
    assert f["adapter.lora.alpha"].contents() == conf["lora"]["alpha"] == 7.0
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    tensors = {t.name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
               for t in reader.tensors}  # fmt: skip
    peft = load_file(str(out / "adapter_model.safetensors"))
    want, permuted = set(), 0
    for key, a in peft.items():
        if ".lora_A." not in key:
            continue
        layer, leaf = key.split(".")[4], key.split(".")[-3]
        name = f"blk.{layer}.{LEAVES[leaf]}.weight"
        want |= {f"{name}.lora_a", f"{name}.lora_b"}
        b = peft[key.replace("lora_A", "lora_B")]
        np.testing.assert_array_equal(tensors[f"{name}.lora_a"], a)  # (r, in): ne [in, r]
        if family == "llama" and leaf in ("q_proj", "k_proj"):
            # (c) llama.cpp's rope pairs adjacent dims: in each head, B's row j * half + i
            # (the halves j = 0, 1) is stored at row 2 * i + j
            heads = case.model.config.num_attention_heads if leaf == "q_proj" else (
                case.model.config.num_key_value_heads)  # fmt: skip
            hd = b.shape[0] // heads
            rows = [h * hd + j * (hd // 2) + i
                    for h in range(heads) for i in range(hd // 2) for j in range(2)]  # fmt: skip
            np.testing.assert_array_equal(tensors[f"{name}.lora_b"], b[rows])
            assert not np.array_equal(b[rows], b)
            permuted += 1
        else:
            np.testing.assert_array_equal(tensors[f"{name}.lora_b"], b)  # (out, r): ne [r, out]
    n_layers = conf["model"]["num_hidden_layers"]
    assert set(tensors) == want and len(want) == 2 * 7 * n_layers
    assert permuted == (2 * n_layers if family == "llama" else 0)


def test_no_gguf_form_says_so_and_a_malformed_one_is_refused(  # type: ignore[no-untyped-def]
    runner_bin: Path, et_cases, tmp_path: Path
) -> None:
    case = et_cases("qwen2", "q4")
    d = _copy(case.dir, tmp_path)
    data = _jsonl(tmp_path / "rows.jsonl", _rows(d))
    _edit_conf(d, lambda c: c.update(gguf_adapter=None))
    out = tmp_path / "none"
    r = _run(runner_bin, d, data, out, "--threads", "1", steps=1)
    assert r.returncode == 0, r.stderr
    note = "no adapter.gguf: the llama.cpp form of this qwen2 adapter is none"
    assert r.stdout.splitlines()[-2] == note
    assert (out / "adapter_config.json").is_file() and not (out / "adapter.gguf").exists()
    lora = _peft_lora(out, _conf(d)["model"]["num_hidden_layers"])
    assert _py_save(_conf(d), lora, tmp_path / "py_none") == note
    assert not (tmp_path / "py_none" / "adapter.gguf").exists()

    _edit_conf(d, lambda c: c.pop("gguf_adapter"))  # an export from before the section
    assert _py_save(_conf(d), lora, tmp_path / "py_old").endswith("was not recorded (export again)")

    sec = _conf(case.dir)["gguf_adapter"]
    sec["tensors"][0]["module"] = "self_attn.nothing"
    _edit_conf(d, lambda c: c.update(gguf_adapter=sec))
    out = tmp_path / "bad"
    _refused(_run(runner_bin, d, data, out, steps=1), out, "gguf_adapter", "self_attn.nothing")
    with pytest.raises(runner.RunnerError, match="malformed gguf_adapter"):
        _py_save(_conf(d), lora, tmp_path / "py_bad")
    assert not (tmp_path / "py_bad").exists()
