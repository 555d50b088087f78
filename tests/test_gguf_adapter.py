"""`mesp export-adapter`: the llama.cpp LoRA GGUF, read back with gguf-py's own GGUFReader, has
the keys, names, shapes and values llama.cpp's convert_lora_to_gguf.py would write for the same
PEFT adapter; and applying it the way llama.cpp does (W + alpha/r · B A, on the base GGUF's
tensors) gives the merged GGUF's tensors, permuted llama q/k rows included."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from mesp.cli import main
from mesp.convert.gguf_model import write_model_gguf
from mesp.convert.gguf_vocab import vocab_kvs
from mesp.convert.merge import merged_tensors
from mesp.loading import load_model
from tests.test_merge import _adapter
from tests.tiny_dir import make_model_dir
from tests.tolerances import gemm_tol

LEAVES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """name -> float32 numpy array in numpy order (out, in), dequantized."""
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(d) for d in reversed(t.shape)]
        )
        for t in gguf.GGUFReader(path).tensors
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_adapter_gguf_is_what_llama_cpp_converter_writes(family: str, tmp_path: Path) -> None:
    base = make_model_dir(tmp_path / "base", family)
    _adapter(base, tmp_path / "ad")
    out = tmp_path / "adapter.gguf"
    argv = ["--model", str(base), "--adapter", str(tmp_path / "ad"), "--out", str(out)]
    assert main(["export-adapter", *argv]) == 0
    reader = gguf.GGUFReader(out)
    f = reader.fields
    assert f["general.architecture"].contents() == family
    assert f["general.type"].contents() == "adapter" and f["adapter.type"].contents() == "lora"
    assert f["adapter.lora.alpha"].types == [gguf.GGUFValueType.FLOAT32]
    assert f["adapter.lora.alpha"].contents() == 8.0  # _adapter: rank 2, alpha 8
    assert not any(k.startswith((f"{family}.", "tokenizer.")) for k in f)  # no hparams, vocab
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)

    peft = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    got = _tensors(out)
    want_names = set()
    for key, a in peft.items():
        if ".lora_A." not in key:
            continue
        layer, leaf = key.split(".")[4], key.split(".")[-3]
        name = f"blk.{layer}.{LEAVES[leaf]}.weight"
        want_names |= {f"{name}.lora_a", f"{name}.lora_b"}
        b = peft[key.replace("lora_A", "lora_B")]
        assert got[f"{name}.lora_a"].shape == a.shape  # (r, in): ggml ne = [in, r]
        assert got[f"{name}.lora_b"].shape == b.shape  # (out, r): ggml ne = [r, out]
        np.testing.assert_array_equal(got[f"{name}.lora_a"], a)
        if family != "llama" or leaf not in ("q_proj", "k_proj"):
            np.testing.assert_array_equal(got[f"{name}.lora_b"], b)
    assert set(got) == want_names and len(want_names) == 2 * 2 * 7

    # llama.cpp's own arithmetic on its own layout: base + alpha/r * B @ A == merged
    loaded = load_model(base)
    base_gguf = tmp_path / "base.gguf"
    vocab = vocab_kvs(loaded, loaded.model.config.vocab_size)
    write_model_gguf(
        loaded.model.config, merged_tensors(loaded.model), vocab, base_gguf, "f32", "b"
    )
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad")]
    assert main([*argv, "--out", str(tmp_path / "m.gguf")]) == 0
    merged, before = _tensors(tmp_path / "m.gguf"), _tensors(base_gguf)
    for name in {n.rsplit(".", 1)[0] for n in want_names}:
        la, lb = got[f"{name}.lora_a"], got[f"{name}.lora_b"]
        delta = 8.0 / 2 * lb @ la  # numpy's GEMM here, torch's in the merge
        rtol, atol = gemm_tol(la.shape[0], scale=4.0 * float(abs(lb).max() * abs(la).max()))
        np.testing.assert_allclose(before[name] + delta, merged[name], atol=atol, rtol=rtol)


def test_export_adapter_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = make_model_dir(tmp_path / "base", "qwen2")
    other = make_model_dir(tmp_path / "other", "qwen2", intermediate_size=64)
    _adapter(base, tmp_path / "ad")
    argv = ["export-adapter", "--adapter", str(tmp_path / "ad"), "--model"]
    for args, words in (
        ([str(base), "--out", str(tmp_path / "a.safetensors")], "ending in .gguf"),
        ([str(other), "--out", str(tmp_path / "a.gguf")], "adapter made for another model"),
    ):
        capsys.readouterr()
        assert main([*argv, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mesp: error: ") and err.count("\n") == 1 and words in err, err
    with pytest.raises(SystemExit) as e:  # argparse refuses a type llama.cpp adapters lack
        main([*argv, str(base), "--out", str(tmp_path / "a.gguf"), "--gguf-type", "q4_0"])
    assert e.value.code == 2
    assert not (tmp_path / "a.gguf").exists()
