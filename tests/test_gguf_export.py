"""`mesp merge … --out FILE.gguf`: transformers' GGUF loader (a reader that is not ours) loads
the merged file and gives the logits of mesp's base + adapter, on every family; quantized types
dequantize to what mesp reads back; a GGUF source's tokenizer keys are carried over as they are.

transformers' loader reads fewer keys than llama.cpp writes, so the bases here are shaped to
its defaults: Qwen3's head_dim is its default 128 (it ignores attention.key_length), Gemma 3's
query_pre_attn_scalar 256 and layer pattern are Gemma3TextConfig's defaults, and llama uses
plain rope (it ignores rope_freqs; mesp's reader checks llama3 scaling below).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from mesp.cli import main
from mesp.convert.merge import merge_into_base
from mesp.loading import load_model
from mesp.loading.gguf import read_metadata
from mesp.loading.tokenizer import Tokenizer
from mesp.lora import load_adapter
from mesp.models.linear import FrozenWeight
from tests.test_gguf import write_model
from tests.test_merge import IDS, WIDE, _adapter
from tests.tiny_dir import make_model_dir

TF_SHAPES = {
    "llama": {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "gemma3": {"layer_types": ["sliding_attention", "sliding_attention"]},
}
TEXT = "To be, or not to be, that is the question:"


def _base(tmp: Path, family: str, **over: object) -> Path:
    base = make_model_dir(tmp / "base", family, **{**TF_SHAPES[family], **over})
    if family == "gemma3":  # hf_tiny fixes 20; transformers' GGUF loader assumes 256
        cfg = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**cfg, "query_pre_attn_scalar": 256}))
    _adapter(base, tmp / "ad")
    return base


def _merge(model: Path, tmp: Path, out: str, *extra: str) -> Path:
    argv = ["merge", "--model", str(model), "--adapter", str(tmp / "ad"), "--out", str(tmp / out)]
    assert main([*argv, *extra]) == 0
    return tmp / out


def _reference(model: Path, tmp: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    ref = load_model(model).model
    load_adapter(ref, tmp / "ad")
    with torch.no_grad():
        return ref(ids)


def _transformers_logits(path: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_merged_gguf_in_transformers_equals_base_plus_adapter(family: str, tmp_path: Path) -> None:
    import transformers

    base = _base(tmp_path, family)
    out = _merge(base, tmp_path, "merged.gguf")
    want = _reference(base, tmp_path)
    torch.testing.assert_close(_transformers_logits(out), want, atol=1e-4, rtol=0)
    back = load_model(out)  # and mesp's own reader undoes every converter edit
    with torch.no_grad():
        torch.testing.assert_close(back.model(IDS), want, atol=1e-5, rtol=0)
    reader = gguf.GGUFReader(out)
    field = reader.fields["general.architecture"]
    assert field.contents() == family and reader.fields["general.type"].contents() == "model"
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    # the tokenizer, rebuilt by transformers and by mesp from the file, is the source's
    src = Tokenizer.from_dir(base)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert hf_tok(TEXT, add_special_tokens=False).input_ids == src.encode(TEXT, add_bos=False)
    assert back.tokenizer is not None and back.tokenizer.encode(TEXT) == src.encode(TEXT)
    assert back.tokenizer.chat_template == src.chat_template
    assert back.tokenizer.eos_id == src.eos_id


@pytest.mark.parametrize("gtype", ["f16", "q8_0", "q4_0"])
def test_quantized_gguf_is_the_merged_model_rounded_by_gguf_quants(
    gtype: str, tmp_path: Path
) -> None:
    base = _base(tmp_path, "qwen2", **WIDE)  # 128-wide rows: every 2-D weight quantizes
    out = _merge(base, tmp_path, f"merged-{gtype}.gguf", "--gguf-type", gtype)
    qt = gguf.GGMLQuantizationType[gtype.upper()]
    # the oracle: base + adapter merged in float32, each weight rounded by gguf's quants
    ref = load_model(base).model
    load_adapter(ref, tmp_path / "ad")
    with torch.no_grad():
        exact = ref(IDS)
    merge_into_base(ref, None)
    for mod in ref.modules():
        if isinstance(mod, FrozenWeight):
            w = mod.dense().numpy()
            mod.set_dense(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qt), qt)))
    got = _transformers_logits(out)
    with torch.no_grad():
        torch.testing.assert_close(got, ref(IDS), atol=1e-4, rtol=0)
        torch.testing.assert_close(load_model(out).model(IDS), got, atol=1e-5, rtol=0)
    assert (got - exact).abs().max() > 1e-4  # the file really is rounded
    for t in gguf.GGUFReader(out).tensors:  # norms and biases stay F32, as llama.cpp's
        assert t.tensor_type == (qt if len(t.shape) == 2 else gguf.GGMLQuantizationType.F32)


def test_llama3_rope_scaling_travels_as_rope_freqs(tmp_path: Path) -> None:
    base = make_model_dir(tmp_path / "base", "llama")  # hf_tiny's llama3 rope, factor 8
    _adapter(base, tmp_path / "ad")
    out = _merge(base, tmp_path, "m.gguf", "--gguf-type", "f32")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(out).tensors}
    back = load_model(out).model
    assert back.config.rope["full_attention"].kind == "llama3"
    with torch.no_grad():
        torch.testing.assert_close(back(IDS), _reference(base, tmp_path), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_gguf_source_keeps_its_tokenizer_keys(family: str, tmp_path: Path) -> None:
    src = tmp_path / "src.gguf"
    write_model(src, family)  # llama: byte-fallback SentencePiece vocab, gemma3: Gemma's
    _adapter(src, tmp_path / "ad")
    out = _merge(src, tmp_path, "m.gguf")
    before, after = read_metadata(src), read_metadata(out)
    keys = {k for k in before if k.startswith("tokenizer.")}
    assert keys and {k for k in after if k.startswith("tokenizer.")} == keys
    assert all(after[k] == before[k] for k in keys)  # value and value type alike
    ids = IDS % 250  # these vocabularies are smaller than tiny_dir's
    want = _reference(src, tmp_path, ids)
    with torch.no_grad():  # Gemma's norms go w + 1 - 1 in float32 twice: 1e-4, not 1e-5
        torch.testing.assert_close(load_model(out).model(ids), want, atol=1e-4, rtol=0)
    if family == "llama":  # transformers reads this file's shape (head_dim via rope dims)
        torch.testing.assert_close(_transformers_logits(out, ids), want, atol=1e-4, rtol=0)


def _fails(argv: list[str], capsys: pytest.CaptureFixture, *words: str) -> None:
    capsys.readouterr()  # drop what the fixtures printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mesp: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err


def test_bad_gguf_merges_fail_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = _base(tmp_path, "qwen2")
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out"]
    _fails([*argv, str(tmp_path / "dir"), "--gguf-type", "q8_0"], capsys, "ending in .gguf")
    _fails([*argv, str(tmp_path / "m.gguf"), "--gguf-type", "q5_k"], capsys, "q4_0")
    _fails([*argv, str(tmp_path / "m.gguf"), "--quantize", "4"], capsys, "--gguf-type")
    (tmp_path / "d.gguf").mkdir()
    _fails([*argv, str(tmp_path / "d.gguf")], capsys, "is a directory")
    # a SentencePiece-style tokenizer.json (byte fallback) spelling spaces Gemma's way has no
    # faithful form in a qwen2 GGUF: readers take the space convention from the architecture
    spm = tmp_path / "spm.gguf"
    write_model(spm, "gemma3")
    tok = load_model(spm).tokenizer
    assert tok is not None
    tok.backend.save(str(base / "tokenizer.json"))
    _fails([*argv, str(tmp_path / "m.gguf")], capsys, "handle spaces", "convert_hf_to_gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_plain_byte_level_bpe_is_llama_cpps_gpt_2(tmp_path: Path) -> None:
    """A tokenizer.json whose only pre-tokenizer is ByteLevel (tiny_dir's) splits as GPT-2: the
    file names it "gpt-2", the name llama.cpp's converter writes and its loader knows (it
    refused "gpt2": unknown pre-tokenizer type), and mesp reads it back to the same ids."""
    base = _base(tmp_path, "qwen2")
    out = _merge(base, tmp_path, "m.gguf")
    assert read_metadata(out)["tokenizer.ggml.pre"][0] == "gpt-2"
    ids = load_model(base).tokenizer.encode(TEXT)
    assert load_model(out).tokenizer.encode(TEXT) == ids and len(ids) > 5
