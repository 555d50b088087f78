"""HF safetensors (sharded, quantized on load) and MLX quantized directories load into the same
model; bad checkpoints give one clear error naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mesp.errors import MespError
from mesp.loading import load_model
from mesp.quant import QuantSpec, quantize, to_uint32
from tests.hf_tiny import hf_model, mesp_from_hf

IDS = torch.randint(0, 211, (1, 15), generator=torch.Generator().manual_seed(7))
Q = QuantSpec(4, 32)
QUANT_SIZES = {"hidden_size": 96, "head_dim": 32, "intermediate_size": 160}


def _write_hf(path: Path, family: str = "qwen3", shards: int = 1, **over) -> dict:  # type: ignore[no-untyped-def]
    hf = hf_model(family, **over)
    path.mkdir(parents=True)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    (path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    names = sorted(sd)
    if shards == 1:
        save_file(sd, str(path / "model.safetensors"))
    else:
        wmap = {}
        for i in range(shards):
            part = {k: sd[k] for k in names[i::shards]}
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(path / fname))
            wmap.update({k: fname for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return {"hf": hf, "sd": sd}


def test_sharded_dir_matches_transformers(tmp_path: Path) -> None:
    hf = _write_hf(tmp_path / "m", "qwen3", shards=3)["hf"]
    model = load_model(tmp_path / "m").model
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), hf(IDS).logits, atol=1e-4, rtol=0)


def test_quantize_on_load_equals_quantizing_in_memory(tmp_path: Path) -> None:
    hf = _write_hf(tmp_path / "m", "llama", **QUANT_SIZES)["hf"]
    loaded = load_model(tmp_path / "m", quant=Q).model
    ref = mesp_from_hf(hf, quant=Q)
    assert loaded.layers[0].mlp.up_proj.quant == Q
    assert loaded.model.embed_tokens.quant == Q  # the embedding is quantized too, as MLX does
    with torch.no_grad():
        assert torch.equal(loaded(IDS), ref(IDS))
        # 4-bit is an approximation, but a close one
        assert (loaded(IDS) - hf(IDS).logits).abs().max() < 0.5


def _write_mlx(root: Path, q: QuantSpec = Q, family: str = "qwen2", **over) -> dict:  # type: ignore[no-untyped-def]
    """An mlx-community style directory: uint32 words + scales + biases for every projection,
    the embedding and an untied lm_head; "quantization" in config.json."""
    w = _write_hf(root / "src", family, **{**QUANT_SIZES, **over})
    out: dict[str, torch.Tensor] = {}
    for k, v in w["sd"].items():
        if k.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")):
            wq, sc, b = quantize(v, q)
            base = k.removesuffix(".weight")
            out[f"{base}.weight"], out[f"{base}.scales"], out[f"{base}.biases"] = (
                to_uint32(wq),
                sc,
                b,
            )
        else:
            out[k] = v
    mlx = root / "mlx"
    mlx.mkdir()
    cfg = {**w["hf"].config.to_dict(), "quantization": {"group_size": q.group_size, "bits": q.bits}}
    (mlx / "config.json").write_text(json.dumps(cfg))
    save_file(out, str(mlx / "model.safetensors"))
    return {**w, "mlx": mlx, "tensors": out}


@pytest.mark.parametrize(
    "q,family",
    [
        (Q, "qwen2"),
        (QuantSpec(8, 64), "llama"),
        (QuantSpec(4, 128), "llama"),
        (QuantSpec(5, 32), "qwen2"),
        (QuantSpec(6, 64), "llama"),
    ],
)
def test_mlx_quantized_dir_loads_bit_exact(tmp_path: Path, q: QuantSpec, family: str) -> None:
    """Loaded without requantizing, an MLX directory equals our own quantization bit for bit
    (4-, 5-, 6- and 8-bit; qwen2's tied embeddings, llama's untied quantized lm_head)."""
    w = _write_mlx(
        tmp_path, q, family, hidden_size=128, num_attention_heads=4, intermediate_size=256
    )
    loaded = load_model(w["mlx"])
    assert (family == "llama") == ("lm_head.scales" in w["tensors"])
    assert loaded.fmt == "mlx"
    k = loaded.model.layers[1].self_attn.k_proj
    want = quantize(w["sd"]["model.layers.1.self_attn.k_proj.weight"], q)[0]
    assert k.quant == q and torch.equal(k.weight, want)
    ref = mesp_from_hf(w["hf"], quant=q)
    with torch.no_grad():
        assert torch.equal(loaded.model(IDS), ref(IDS))


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing_biases", "is packed but model.layers.0.mlp.up_proj.biases is missing"),
        ("bits_string", "bits and group_size must be integers"),
        ("bits_3", "quantization bits must be 4, 5, 6 or 8"),
        ("group_mismatch", "scales/biases have shapes .* at group size 64"),
    ],
)
def test_bad_mlx_dirs(tmp_path: Path, case: str, match: str) -> None:
    w = _write_mlx(tmp_path)
    mlx, tensors = w["mlx"], dict(w["tensors"])
    cfg = json.loads((mlx / "config.json").read_text())
    if case == "missing_biases":
        del tensors["model.layers.0.mlp.up_proj.biases"]
        save_file(tensors, str(mlx / "model.safetensors"))
    else:
        quant = {"bits_string": {"bits": "four"}, "bits_3": {"bits": 3, "group_size": 32}}.get(
            case, {"bits": 4, "group_size": 64}
        )
        (mlx / "config.json").write_text(json.dumps({**cfg, "quantization": quant}))
    with pytest.raises(MespError, match=match) as e:
        load_model(mlx)
    assert "\n" not in str(e.value) and str(mlx) in str(e.value)


def test_mlx_layout_matches_mlx_itself(tmp_path: Path) -> None:
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    w = torch.randn(64, 128)
    wq, s, b = mx.quantize(mx.array(w.numpy()), group_size=64, bits=4)
    ours = quantize(w, QuantSpec(4, 64))
    assert np.array_equal(np.array(wq).view(np.int32), ours[0].numpy())
    assert np.array_equal(np.array(s), ours[1].numpy()) and np.array_equal(
        np.array(b), ours[2].numpy()
    )


@pytest.mark.parametrize(
    "case",
    ["unknown_arch", "missing_config", "truncated", "bad_shape", "missing_tensor", "not_json"],
)
def test_bad_checkpoints(case: str, tmp_path: Path) -> None:
    m = tmp_path / "m"
    _write_hf(m, "llama")
    cfg = json.loads((m / "config.json").read_text())
    if case == "unknown_arch":
        (m / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
        match = "model_type 'falcon' is not supported"
    elif case == "missing_config":
        (m / "config.json").unlink()
        match = "missing config.json"
    elif case == "truncated":
        f = m / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        match = "truncated"
    elif case == "bad_shape":
        (m / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 140}))
        match = "has shape .* config expects"
    elif case == "missing_tensor":
        (m / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
        match = "missing tensor model.layers.2"
    else:
        (m / "config.json").write_text("{nope")
        match = "not valid JSON"
    with pytest.raises(MespError, match=match) as e:
        load_model(m)
    assert "\n" not in str(e.value) and str(m) in str(e.value)


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path: Path, prefix: str) -> None:
    """A Gemma 3 image-text checkpoint (model_type gemma3, text_config, the text weights under
    a language-model prefix, a vision tower beside them): mesp loads the language model."""
    w = _write_hf(tmp_path / "text", "gemma3")
    hf = w["hf"]
    m = tmp_path / "mm"
    m.mkdir()
    sd = {prefix + k.removeprefix("model."): v for k, v in w["sd"].items()}
    sd["model.vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    sd["model.multi_modal_projector.norm.weight"] = torch.zeros(4)
    save_file(sd, str(m / "model.safetensors"))
    text = hf.config.to_dict()
    (m / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    loaded = load_model(m).model
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), hf(IDS).logits, atol=1e-4, rtol=0)
