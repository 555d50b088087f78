"""GGUF for issue 29's families, as llama.cpp's convert_hf_to_gguf.py writes them: Mistral as
arch "llama" (LlamaModel, q/k rows permuted, no window), Gemma 2 as "gemma2" (1 + w norms, the
two soft-caps and the window as keys, no rope key). `merge --out X.gguf` reads back through
transformers' GGUF loader and mesp's own with the logits of base + adapter; `export-adapter`
writes llama.cpp's LoRA tensors; what llama.cpp's architecture cannot express is refused.

transformers' loader reads fewer keys than llama.cpp: for Gemma 2 it takes the soft-caps and
query_pre_attn_scalar from Gemma2Config's defaults (50, 30, 256), so its base is shaped to
them (head_dim 256, which llama.cpp's scale assumes); the hf_tiny caps (0.05, 0.3), where tanh
bends, go through mesp's reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from mesp.cli import main
from mesp.convert.gguf_model import write_model_gguf
from mesp.convert.gguf_vocab import vocab_kvs
from mesp.convert.merge import merged_tensors
from mesp.loading import load_model
from tests.hf_tiny import BASE, n_lora, phi3_extras
from tests.test_gguf_adapter import LEAVES, _tensors
from tests.test_gguf_export import _merge, _reference, _transformers_logits
from tests.test_merge import IDS, _adapter
from tests.tiny_dir import make_model_dir
from tests.tolerances import gemm_tol

# shapes llama.cpp's architecture (and transformers' loader where it reads the family) express
SHAPES: dict[str, dict[str, object]] = {
    "mistral": {"sliding_window": None},
    "gemma2": {},
    "gemma2-tf": {"head_dim": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "olmo2": {},
    "granite": {},  # hf_tiny's four multipliers, each away from 1
    # llama.cpp's SmolLM3: NoPE on every 4th layer, no window
    "smollm3": {
        "num_hidden_layers": 4,
        "no_rope_layers": [1, 1, 1, 0],
        "use_sliding_window": False,
    },
    "phi3": {},  # hf_tiny's: 3/4 of each head rotates, LongRoPE, a window of 5
    # what transformers' loader reads of a Phi-3 GGUF: whole-head rotary, plain rope, no window
    "phi3-tf": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 7000.0},
        "partial_rotary_factor": 1.0,
        "sliding_window": None,
    },
}
ARCH = {"mistral": "llama"} | {f: f for f in ("gemma2", "olmo2", "granite", "smollm3", "phi3")}
# transformers' GGUF loader reads none of these architectures (Phi-3: not its rotary part,
# LongRoPE or window): mesp's reader is the check
MESP_ONLY = ["olmo2", "granite", "smollm3", "phi3"]
# PEFT's leaf -> llama.cpp's; Phi-3's fused linears are written fused
GGUF_LEAVES = {**LEAVES, "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}


def _base(tmp: Path, case: str) -> Path:
    family = case.removesuffix("-tf")
    base = make_model_dir(tmp / f"tiny-{family}", family, **SHAPES[case])
    if family == "gemma2":  # llama.cpp's scale: 1/sqrt(head_dim) (hf_tiny fixes 20)
        _edit_config(base, query_pre_attn_scalar=SHAPES[case].get("head_dim", 24))
    _adapter(base, tmp / "ad")
    return base


def _edit_config(base: Path, **keys: object) -> None:
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, **keys}))


@pytest.mark.parametrize("case", ["mistral", "gemma2-tf", "phi3-tf"])
def test_merged_gguf_in_transformers_equals_base_plus_adapter(case: str, tmp_path: Path) -> None:
    import transformers

    base = _base(tmp_path, case)
    out = _merge(base, tmp_path, "merged.gguf")
    want = _reference(base, tmp_path)
    torch.testing.assert_close(_transformers_logits(out), want, atol=1e-4, rtol=0)
    cfg = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=out.name)
    # transformers' Mistral patch tests `"mistral" in [general.name]` (list membership), so
    # only a file named exactly "mistral" loads as Mistral; as llama the math is the same
    assert cfg.model_type == {"mistral": "llama", "phi3-tf": "phi3"}.get(case, "gemma2")
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == ARCH[case.removesuffix("-tf")]


@pytest.mark.parametrize("case", ["mistral", "gemma2", *MESP_ONLY])
def test_merged_gguf_in_mesp_equals_base_plus_adapter(case: str, tmp_path: Path) -> None:
    base = _base(tmp_path, case)
    out = _merge(base, tmp_path, "merged.gguf")
    want = _reference(base, tmp_path)
    back = load_model(out)
    with torch.no_grad():
        torch.testing.assert_close(back.model(IDS), want, atol=1e-5, rtol=0)
    fields = gguf.GGUFReader(out).fields
    if case == "gemma2":  # Gemma2Model's keys, and no rope base (llama.cpp assumes 10000)
        assert fields["gemma2.attn_logit_softcapping"].contents() == pytest.approx(0.05)
        assert fields["gemma2.final_logit_softcapping"].contents() == pytest.approx(0.3)
        assert fields["gemma2.attention.sliding_window"].contents() == 5
        assert "gemma2.rope.freq_base" not in fields
        assert back.model.config.layer_types == ["sliding_attention", "full_attention"]
    if case == "granite":  # GraniteModel's *_scale keys
        want = {"attention.scale": 0.07, "embedding_scale": 3.0, "residual_scale": 0.4}
        for key, value in {**want, "logit_scale": 2.5}.items():
            assert fields[f"granite.{key}"].contents() == pytest.approx(value)
    if case == "smollm3":
        assert back.model.config.rope_layers == [True, True, True, False]
    if case == "phi3":  # Phi3MiniModel's keys and LongRoPE's two factor tensors
        assert fields["phi3.rope.dimension_count"].contents() == 18
        assert fields["phi3.attention.sliding_window"].contents() == 5
        assert fields["phi3.rope.scaling.original_context_length"].contents() == 16
        assert fields["phi3.rope.scaling.attn_factor"].contents() == pytest.approx(2**0.5)
        names = {t.name for t in gguf.GGUFReader(out).tensors}
        assert {"rope_factors_long.weight", "blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names
        got, want = back.model.config.rope["full_attention"], load_model(base).model.config.rope
        want = want["full_attention"]  # the factors come back as the file's float32
        assert (got.kind, got.partial_rotary_factor) == ("longrope", 0.75)
        assert got.original_max_position_embeddings == 16
        assert got.long_factor == pytest.approx(want.long_factor, rel=1e-7)
        assert got.short_factor == pytest.approx(want.short_factor, rel=1e-7)


# the export's only per-family step is PERMUTED's q/k rows: Mistral and Gemma 2 cover both
# branches in the fast suite, the other three run in the slow one
@pytest.mark.parametrize(
    "case", ["mistral", "gemma2", *(pytest.param(f, marks=pytest.mark.slow) for f in MESP_ONLY)]
)
def test_adapter_gguf_applies_to_the_base_gguf(case: str, tmp_path: Path) -> None:
    """llama.cpp's LoRA arithmetic on the exported tensors (base + alpha/r B A, in the file's
    own layout: Mistral's q/k rows permuted) gives the merged GGUF's tensors."""
    base = _base(tmp_path, case)
    out = tmp_path / "adapter.gguf"
    argv = ["--model", str(base), "--adapter", str(tmp_path / "ad"), "--out", str(out)]
    assert main(["export-adapter", *argv]) == 0
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == ARCH[case]
    got = _tensors(out)
    peft = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    names = set()
    for key, a in peft.items():
        if ".lora_A." in key:
            name = f"blk.{key.split('.')[4]}.{GGUF_LEAVES[key.split('.')[-3]]}.weight"
            names.add(name)
            np.testing.assert_array_equal(got[f"{name}.lora_a"], a)
    n_layers = int(SHAPES[case].get("num_hidden_layers", 2))  # type: ignore[call-overload]
    assert {n.rsplit(".", 1)[0] for n in got} == names
    assert len(names) == n_layers * n_lora(case)
    merged = _tensors(_merge(base, tmp_path, "m.gguf"))
    save_file(  # B zeroed: the adapter merges to the base itself
        {k: np.zeros_like(v) if ".lora_B." in k else v for k, v in peft.items()},
        str(tmp_path / "ad" / "adapter_model.safetensors"),
    )
    before = _tensors(_merge(base, tmp_path, "base.gguf"))
    for name in names:
        la, lb = got[f"{name}.lora_a"], got[f"{name}.lora_b"]
        delta = 8.0 / 2 * lb @ la  # numpy's GEMM here, torch's in the merge
        rtol, atol = gemm_tol(la.shape[0], scale=4.0 * float(abs(lb).max() * abs(la).max()))
        np.testing.assert_allclose(before[name] + delta, merged[name], atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "family,keys,words",
    [
        ("mistral", {}, "sliding_window 5"),  # hf_tiny's window, shorter than the context
        ("gemma2", {}, "query_pre_attn_scalar 20"),  # hf_tiny's 20, head_dim 24
        (
            "gemma2",
            {"query_pre_attn_scalar": 24, "rope_parameters": {"rope_theta": 5e3}},
            "theta 10000",
        ),
        ("gemma2", {"query_pre_attn_scalar": 24, "final_logit_softcapping": None}, "soft-caps"),
        ("smollm3", {}, "every 4th layer"),  # hf_tiny's alternating NoPE layers
        ("smollm3", {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}, "sliding window"),
        ("granite", {"head_dim": 12}, "head_dim"),
        ("phi3", {"head_dim": 12}, "head_dim"),
        (
            "phi3",
            {"rope_parameters": {**phi3_extras(BASE)["rope_parameters"], "attention_factor": 1.1}},
            "attention factor",
        ),
    ],
)
def test_what_llama_cpp_cannot_express_is_refused_in_one_line(
    family: str, keys: dict, words: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shaped = ("num_hidden_layers", "no_rope_layers", "head_dim")  # change the weights too
    base = make_model_dir(
        tmp_path / "base", family, **{k: keys.pop(k) for k in shaped if k in keys}
    )
    if "rope_parameters" in keys:
        keys["rope_parameters"] = {"rope_type": "default", **keys["rope_parameters"]}
    _edit_config(base, **keys)
    _adapter(base, tmp_path / "ad")
    capsys.readouterr()
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad")]
    assert main([*argv, "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mesp: error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("case", ["mistral", "gemma2", *MESP_ONLY])
def test_base_gguf_in_mesp_has_the_transformers_logits(case: str, tmp_path: Path) -> None:
    """The base alone (no adapter) written as llama.cpp's converter would, read back by mesp:
    transformers' logits for the HF directory it came from."""
    import transformers

    family = case.removesuffix("-tf")
    base = make_model_dir(tmp_path / "base", family, **SHAPES[case])
    if family == "gemma2":
        _edit_config(base, query_pre_attn_scalar=24)
    loaded = load_model(base)
    out = tmp_path / "base.gguf"
    vocab = vocab_kvs(loaded, loaded.model.config.vocab_size)
    write_model_gguf(loaded.model.config, merged_tensors(loaded.model), vocab, out, "f32", "b")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = hf(IDS).logits, load_model(out).model(IDS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_phi3_fused_qkv_takes_llama_quantizes_type() -> None:
    """llama-quantize's rule for a fused attn_qkv.weight (llama_tensor_get_type): Q5_K in a
    q4_k_m file, Q6_K in q5_k_m, the file's own Q6_K in q6_k; in every layer."""
    from gguf import GGMLQuantizationType as QT

    from mesp.convert.gguf_mix import mix_type

    for layer in range(8):
        name, shape = f"blk.{layer}.attn_qkv.weight", (768, 256)
        assert mix_type(name, shape, "q4_k_m", 8, False) == QT.Q5_K
        assert mix_type(name, shape, "q5_k_m", 8, False) == QT.Q6_K
        assert mix_type(name, shape, "q6_k", 8, False) == QT.Q6_K
        assert mix_type(f"blk.{layer}.ffn_up.weight", shape, "q4_k_m", 8, False) == QT.Q4_K
