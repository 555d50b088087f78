"""read_gguf on tiny GGUF files written here the way llama.cpp's converter writes them.

Each file holds random HF weights after llama.cpp's edits (q/k row permutation for llama, +1 on
Gemma norms), some tensors quantized; reading it back must give the HF tensors. Where transformers
can load the same file, its state dict and tokenizer ids are the oracle too.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from mesp.errors import MespError
from mesp.loading.gguf import read_gguf
from mesp.loading.gguf_tokenizer import _bytes_to_unicode

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# (hidden, heads, kv heads, head_dim, intermediate): head_dim*heads != hidden on purpose for
# llama/gemma3; rows that get quantized need an input size that is a multiple of 32.
DIMS = {
    "llama": (96, 3, 1, 24, 40),
    "qwen2": (72, 3, 1, 24, 64),
    "qwen3": (96, 3, 1, 32, 40),
    "gemma3": (96, 3, 1, 24, 40),
}
# GGUF leaf -> (HF leaf, storage type when the input size allows quantizing)
LEAVES = {
    "attn_norm.weight": ("input_layernorm.weight", QT.F32),
    "attn_q.weight": ("self_attn.q_proj.weight", QT.Q8_0),
    "attn_k.weight": ("self_attn.k_proj.weight", QT.Q4_0),
    "attn_v.weight": ("self_attn.v_proj.weight", QT.F16),
    "attn_output.weight": ("self_attn.o_proj.weight", QT.BF16),
    "ffn_gate.weight": ("mlp.gate_proj.weight", QT.Q5_0),
    "ffn_up.weight": ("mlp.up_proj.weight", QT.Q5_1),
    "ffn_down.weight": ("mlp.down_proj.weight", QT.Q4_0),
    "ffn_norm.weight": ("post_attention_layernorm.weight", QT.F32),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("a", "n"),
    ("Ġ", "an"),
    ("Ġan", "d"),
    ("Ġ", "Ġ"),
    ("Ċ", "Ċ"),
    ("1", "2"),
    ("Ġ", "1"),
]
SPM_PIECES = ["▁", "t", "h", "e", "a", "n", "d", "▁t", "he", "▁the", "an", "▁an", "▁and"]
TEXTS = [
    "the and then",
    " the  an\nand\n\n",
    "héllo 12 ☃ 日本",
    "<|im_start|>the<|im_end|>",
    "<start_of_turn>the and<end_of_turn>\n",
    "",
    "   ",
    "a    b\t\tc 123456",
]


def _byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = list(_bytes_to_unicode().values()) + [a + b for a, b in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """Gemma/Llama-2 style: specials, 256 byte tokens, pieces (scores = merge priority)."""
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = head + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["\n", "  "]
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4, 4]
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(SPM_PIECES) + 2)]
    return tokens, types, scores


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (HF -> GGUF row order)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_model(
    path: Path,
    arch: str,
    *,
    drop_key: str | None = None,
    n_layers: int = 2,
    extra_tensors: tuple = (),
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF; return the HF tensors a faithful reader must produce."""
    hidden, heads, kv, hd, inter = DIMS[arch]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    kvs = {
        "block_count": n_layers,
        "context_length": 256,
        "embedding_length": hidden,
        "feed_forward_length": inter,
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 5000.0,
        "attention.key_length": hd,
        "attention.value_length": hd,
    }
    if arch == "llama":  # llama.cpp's LlamaModel writes head_dim as the rope dimension count
        kvs["rope.dimension_count"] = kvs.pop("attention.key_length")
        del kvs["attention.value_length"]
    if arch == "gemma3":
        kvs["attention.sliding_window"] = 16
    for key, value in kvs.items():
        if key != drop_key:
            w.add_key_value(
                f"{arch}.{key}",
                value,
                gguf.GGUFValueType.FLOAT32
                if isinstance(value, float)
                else gguf.GGUFValueType.UINT32,
            )
    if arch in ("llama", "gemma3"):
        tokens, types, scores = _spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
    else:
        tokens, types, merges = _byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, data, qtype in extra_tensors:
        w.add_tensor(name, data, raw_dtype=qtype)

    hf: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, x: np.ndarray, qtype: QT = QT.F32) -> None:
        stored = x
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = _permute(x, heads if "attn_q" in gguf_name else kv)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            stored = x + np.float32(1.0)
        if qtype not in (QT.F32, QT.F16, QT.BF16) and x.shape[-1] % 32:
            qtype = QT.F32
        data = gguf.quants.quantize(stored, qtype)
        w.add_tensor(gguf_name, data, raw_dtype=qtype)
        # Row-wise quantization commutes with the row permutation, so expect the round trip;
        # Gemma's +1 then -1 is not exact in float32, so expect that rounding too.
        hf[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
        if stored is not x and arch == "gemma3":
            hf[hf_name] = stored - np.float32(1.0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    put("token_embd.weight", "model.embed_tokens.weight", rand(len(tokens), hidden), QT.Q8_0)
    put("output_norm.weight", "model.norm.weight", rand(hidden))
    if arch in ("llama", "qwen3"):  # these two keep a separate lm_head
        put("output.weight", "lm_head.weight", rand(len(tokens), hidden), QT.Q4_0)
    shapes = {
        "attn_norm": (hidden,),
        "attn_q": (heads * hd, hidden),
        "attn_k": (kv * hd, hidden),
        "attn_v": (kv * hd, hidden),
        "attn_output": (hidden, heads * hd),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
        "ffn_norm": (hidden,),
    }
    leaves = dict(LEAVES)
    if arch in ("qwen3", "gemma3"):
        leaves["attn_q_norm.weight"] = ("self_attn.q_norm.weight", QT.F32)
        leaves["attn_k_norm.weight"] = ("self_attn.k_norm.weight", QT.F32)
        shapes.update(attn_q_norm=(hd,), attn_k_norm=(hd,))
    if arch == "gemma3":
        leaves["ffn_norm.weight"] = ("pre_feedforward_layernorm.weight", QT.F32)
        leaves["post_attention_norm.weight"] = ("post_attention_layernorm.weight", QT.F32)
        leaves["post_ffw_norm.weight"] = ("post_feedforward_layernorm.weight", QT.F32)
        shapes.update(post_attention_norm=(hidden,), post_ffw_norm=(hidden,))
    if arch == "qwen2":
        for x in "qkv":
            leaves[f"attn_{x}.bias"] = (f"self_attn.{x}_proj.bias", QT.F32)
            shapes[f"attn_{x}.bias"] = ((heads if x == "q" else kv) * hd,)
    for i in range(n_layers):
        for leaf, (hf_leaf, qtype) in leaves.items():
            shape = shapes[leaf.removesuffix(".weight")]
            put(f"blk.{i}.{leaf}", f"model.layers.{i}.{hf_leaf}", rand(*shape), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    want = write_model(path, arch)
    cfg, tensors, tok = read_gguf(path)
    assert set(tensors) == set(want)
    for name, value in want.items():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], torch.from_numpy(value)), name
    if arch == "gemma3":  # and the -1 really undid the +1
        assert tensors["model.norm.weight"].abs().max() < 3
    hidden, heads, kv, hd, inter = DIMS[arch]
    assert cfg["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["intermediate_size"],
    ) == (hidden, heads, kv, hd, inter)
    assert cfg["vocab_size"] == tok.vocab_size == tensors["model.embed_tokens.weight"].shape[0]
    assert cfg["num_hidden_layers"] == 2 and cfg["rope_theta"] == 5000.0
    assert cfg["tie_word_embeddings"] == (arch not in ("llama", "qwen3"))
    assert math.isclose(cfg["rms_norm_eps"], 1e-6, rel_tol=1e-6)
    if arch == "gemma3":
        assert cfg["sliding_window"] == 16 and cfg["query_pre_attn_scalar"] == hd
        assert cfg["layer_types"] == ["sliding_attention"] * 2
        assert cfg["rope_local_base_freq"] == 10000.0
    assert tok.chat_template and tok.apply_chat_template([{"role": "u", "content": "x"}]) == "x"
    assert tok.add_bos == (arch in ("llama", "gemma3"))
    stop = {tok.backend.id_to_token(i) for i in tok.stop_ids}
    assert stop == (
        {"<eos>", "<end_of_turn>"}
        if arch in ("llama", "gemma3")
        else {"<|im_end|>", "<|endoftext|>"}
    )


def smollm_pre_tokenizer():  # type: ignore[no-untyped-def]
    """What SmolLM2's own tokenizer.json (and llama.cpp's "smollm" regexes) do: every digit on
    its own, then GPT-2's split. transformers' GGUF loader drops the digit step, so " 1" can become
    one token there but never in the real model; we follow the model and patch the oracle."""
    from tokenizers import pre_tokenizers as pt

    return pt.Sequence(
        [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / f"tiny-{arch}.gguf"
    write_model(path, arch)
    _, tensors, tok = read_gguf(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    if arch == "qwen3":  # written with pre "smollm"; see smollm_pre_tokenizer
        hf_tok.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
    for text in TEXTS:
        ids = tok.backend.encode(text, add_special_tokens=False).ids
        assert ids == hf_tok(text, add_special_tokens=False).input_ids, text
        assert tok.encode(text) == hf_tok(text).input_ids, text
        assert tok.decode(ids, skip_special=False) == hf_tok.decode(ids), text
    if arch == "qwen3":  # transformers ignores qwen3.attention.key_length: wrong head_dim
        return
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    assert set(sd) == set(tensors)
    for name, value in sd.items():
        assert torch.equal(value, tensors[name]), name


def test_llama3_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3 rope scaling as a `rope_freqs` tensor; we recover the config."""
    for low, high, factor in ((1.0, 4.0, 32.0), (1.5, 6.0, 8.0)):
        inv = 1.0 / 5000.0 ** (np.arange(0, 24, 2) / 24)  # llama head_dim 24, theta 5000
        smooth = np.clip((8192 * inv / (2 * math.pi) - low) / (high - low), 0, 1)
        freqs = (1 / ((1 - smooth) / factor + smooth)).astype(np.float32)
        path = tmp_path / f"rope-{factor}.gguf"
        write_model(path, "llama", extra_tensors=[("rope_freqs.weight", freqs, None)])
        cfg, tensors, _ = read_gguf(path)
        rs = cfg["rope_scaling"]
        assert rs["rope_type"] == "llama3" and rs["factor"] == factor
        assert math.isclose(rs["low_freq_factor"], low, rel_tol=1e-3)
        assert math.isclose(rs["high_freq_factor"], high, rel_tol=1e-3)
        assert rs["original_max_position_embeddings"] == 8192
        assert not any("rope" in k for k in tensors)


def _fails(path: Path, *words: str) -> None:
    with pytest.raises(MespError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for word in words:
        assert word in msg, msg


def test_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    write_model(good, "qwen2")
    data = good.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 5000, 30):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        _fails(tmp_path / "cut.gguf", "truncated")
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    _fails(tmp_path / "magic.gguf", "not a GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _fails(tmp_path / "empty.gguf", "not a GGUF file")
    _fails(tmp_path / "missing.gguf", "cannot open")


def test_bad_metadata(tmp_path: Path) -> None:
    path = tmp_path / "nokey.gguf"
    write_model(path, "gemma3", drop_key="attention.sliding_window")
    _fails(path, "missing metadata key 'gemma3.attention.sliding_window'")
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _fails(path, "general.architecture = 'falcon' is not supported")
    path = tmp_path / "odd.gguf"
    odd = np.zeros((2, 32), np.float32)
    write_model(path, "llama", extra_tensors=[("blk.0.odd.weight", odd, None)])
    _fails(path, "unexpected tensor 'blk.0.odd.weight'")


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.IQ4_NL, QT.Q8_1], ids=lambda q: q.name)
def test_unsupported_quant(tmp_path: Path, qtype: QT) -> None:
    path = tmp_path / f"{qtype.name}.gguf"
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((2, 256 // block * size), np.uint8)  # 2 rows of 256 values, any bytes
    write_model(path, "llama", extra_tensors=[("blk.0.odd.weight", raw, qtype)])
    _fails(path, "blk.0.odd.weight", qtype.name, "unsupported quant type")
    path = tmp_path / "i32.gguf"
    write_model(path, "llama", extra_tensors=[("blk.0.odd.weight", np.zeros(8, np.int32), None)])
    _fails(path, "blk.0.odd.weight", "I32")
