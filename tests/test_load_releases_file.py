"""Once a model is built, nothing of its source file stays mapped: not after an HF directory
(one file or sharded, kept dense or quantized on load), an MLX directory or a GGUF file. A kept
view of the file would hold the whole mapping, and every page read while loading, resident for
as long as the model lives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mesp.config import ModelConfig
from mesp.convert.merge import write_model_dir
from mesp.loading import load_model, random_model
from mesp.memory.rss import run_child
from mesp.quant import QuantSpec
from tests.test_gguf import write_model as write_gguf
from tests.test_loading import IDS, QUANT_SIZES, _write_hf, _write_mlx

Q = QuantSpec(4, 32)
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self")


def _mapped(path: Path) -> list[str]:
    """Lines of /proc/self/maps that map a file under path."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [line for line in maps if str(path.resolve()) in line]


def _source(tmp_path: Path, fmt: str) -> Path:
    if fmt == "gguf":
        write_gguf(tmp_path / "m.gguf", "qwen2")
        return tmp_path / "m.gguf"
    if fmt == "mlx":
        return _write_mlx(tmp_path)["mlx"]
    _write_hf(tmp_path / "m", "qwen2", shards=3 if fmt == "hf-sharded" else 1, **QUANT_SIZES)
    return tmp_path / "m"


@pytest.mark.parametrize("fmt", ["hf", "hf-sharded", "mlx", "gguf"])
@pytest.mark.parametrize("quant", [None, Q], ids=["dense", "q4"])
def test_nothing_of_the_source_stays_mapped(tmp_path: Path, fmt: str, quant: QuantSpec) -> None:
    src = _source(tmp_path, fmt)
    loaded = load_model(src, quant=quant)
    assert _mapped(tmp_path) == []
    with torch.no_grad():
        before = loaded.model(IDS)
    # the weights are the model's own: zeroing the file in place (no new inode, as a re-download
    # or a merge onto it might) changes nothing, where a view of a private mapping would see it
    for f in [src] if src.is_file() else src.glob("*.safetensors"):
        with open(f, "r+b") as fh:
            fh.write(bytes(f.stat().st_size))
    with torch.no_grad():
        assert torch.equal(loaded.model(IDS), before)


CHILD = """
import gc, sys
from mesp.loading import load_model
from mesp.memory.rss import report, rss_parts
from mesp.quant import QuantSpec
q = QuantSpec(4, 64)
load_model(sys.argv[2], quant=q)  # warm-up: every library and code path of a load is paged in
gc.collect()
before = rss_parts()
model = load_model(sys.argv[1], quant=q).model
gc.collect()
after = rss_parts()
weights = sum(b.numel() * b.element_size() for b in model.buffers())
report(before=before, after=after, weights=weights)
"""


def _random_dir(path: Path, layers: int, vocab: int) -> Path:
    cfg = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
        }
    )
    path.mkdir()
    write_model_dir(random_model(cfg), None, path)
    return path


def test_quantize_on_load_leaves_no_file_backed_memory(tmp_path: Path) -> None:
    """A fresh process (malloc told to unmap what is freed) quantizes a 62 MiB fp32 directory to
    4 bits on load: the file-backed RSS the load adds stays below the 4-bit weights' size (the
    whole file stayed resident before), and the anonymous RSS it adds is the 4-bit weights."""
    big = _random_dir(tmp_path / "big", layers=3, vocab=8192)
    small = _random_dir(tmp_path / "small", layers=1, vocab=256)
    file_bytes = (big / "model.safetensors").stat().st_size
    r = run_child(["-c", CHILD, str(big), str(small)])
    added_file = r["after"]["file"] - r["before"]["file"]
    added_anon = r["after"]["anon"] - r["before"]["anon"]
    assert r["weights"] < file_bytes / 6  # 4-bit words plus fp32 scales and biases
    assert added_file < r["weights"], (added_file, r)
    assert 0.8 * r["weights"] < added_anon < 2 * r["weights"], (added_anon, r)
