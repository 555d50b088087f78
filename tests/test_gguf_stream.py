"""`mesp merge … --out FILE.gguf` streams: header, keys and tensor infos first, then each tensor
made (merged, permuted, quantized) right before its bytes are written and dropped after.

The oracle for the bytes is the writer as it was before streaming (`_eager_write`, kept here):
merge every weight in place, hand every converted tensor to GGUFWriter.add_tensor, then write
them all. The streamed file must equal it byte for byte. The memory bound is measured, not
assumed: new torch storages (mesp's LiveTensorTracker) plus numpy's allocations (tracemalloc)
during the write stay within a few times the largest tensor, while the eager writer's grow with
the sum of all of them.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import gguf
import pytest
import torch

from mesp.cli import main
from mesp.convert import gguf_model as gm
from mesp.convert.gguf_spm import KV
from mesp.convert.gguf_vocab import vocab_kvs
from mesp.convert.merge import merge_into_base, merged_tensors, model_tensors
from mesp.loading import load_model
from mesp.lora import load_adapter
from mesp.memory import LiveTensorTracker
from tests.test_gguf_export import _fails, _merge
from tests.test_merge import WIDE, _adapter
from tests.tiny_dir import make_model_dir


def _eager_write(cfg, tensors: dict[str, torch.Tensor], vocab: list[KV], out: Path, gtype: str):
    """The pre-streaming writer: every output array held by the GGUFWriter until the end."""
    want, ftype = gm.GGUF_TYPES[gtype]
    if cfg.tie_word_embeddings:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    names = gm.gguf_names(cfg, tensors)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gm.ARCHS[cfg.family]])
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("base")
    gm.add_hparams(w, cfg)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for kv in vocab:
        w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub)
    for hf_name, t in tensors.items():
        gname = names[hf_name]
        data = gm.to_llama_cpp(gname, t.detach().float().cpu().numpy(), cfg)
        qtype = gm.storage_type(gname, data.shape, want)
        w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    freqs = gm.llama3_rope_freqs(cfg)
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _model(tmp: Path, family: str, **over: int) -> Path:
    base = make_model_dir(tmp / "base", family, **{**WIDE, **over})
    _adapter(base, tmp / "ad")
    return base


def _eager_file(base: Path, tmp: Path, gtype: str, measure: bool = False) -> tuple[Path, dict]:
    """The old writer's file for base + adapter (and, measured, its live bytes as it writes)."""
    loaded = load_model(base)
    load_adapter(loaded.model, tmp / "ad")
    vocab = vocab_kvs(loaded, loaded.model.config.vocab_size)
    merge_into_base(loaded.model, None)
    tensors = model_tensors(loaded.model)
    out = tmp / f"eager-{gtype}.gguf"
    write = lambda: _eager_write(loaded.model.config, tensors, vocab, out, gtype)  # noqa: E731
    if not measure:
        write()
        return out, {}
    return out, _measured(write)


NUMPY = 389047  # numpy's tracemalloc domain: its array buffers, and nothing else


def _measured(fn) -> dict:
    """Run fn; the most tensor bytes live as a tensor's bytes go to the file (new torch storages
    by mesp's LiveTensorTracker + numpy buffers by tracemalloc), the torch peak, and the sum of
    the torch and tracemalloc (all Python allocations) peaks: a bound on everything at once."""
    tracker, at_write = LiveTensorTracker(), [0]

    def sample(real):
        def wrapped(*a, **k):
            snap = tracemalloc.take_snapshot()
            arrays = snap.filter_traces([tracemalloc.DomainFilter(True, NUMPY)]).traces
            at_write[0] = max(at_write[0], tracker.current_bytes + sum(t.size for t in arrays))
            return real(*a, **k)

        return wrapped

    mp = pytest.MonkeyPatch()
    for name in ("write_tensor_data", "write_tensors_to_file"):
        mp.setattr(gguf.GGUFWriter, name, sample(getattr(gguf.GGUFWriter, name)))
    tracemalloc.start()
    try:
        with tracker:
            fn()
        py_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        mp.undo()
    peak = tracker.peak_bytes + py_peak
    return {"at_write": at_write[0], "torch_peak": tracker.peak_bytes, "peak": peak}


@pytest.mark.parametrize(
    ("family", "gtype"),
    [("llama", "q8_0"), ("llama", "f32"), ("gemma3", "f16"), ("qwen2", "q4_0"), ("qwen3", "bf16")],
)
def test_streamed_gguf_is_byte_identical_to_the_eager_writer(
    family: str, gtype: str, tmp_path: Path
) -> None:
    # llama: q/k permuted per head and hf_tiny's llama3 rope as rope_freqs; gemma3: norms + 1;
    # the 40-wide MLP rows of qwen2 do not split into q4_0 blocks: the F16 fallback
    over = {"intermediate_size": 40} if family == "qwen2" else {}
    base = _model(tmp_path, family, **over)
    want, _ = _eager_file(base, tmp_path, gtype)
    got = _merge(base, tmp_path, "base.gguf", "--gguf-type", gtype)
    assert got.read_bytes() == want.read_bytes()
    types = {t.tensor_type for t in gguf.GGUFReader(got).tensors}  # the case is the one named
    assert gguf.GGMLQuantizationType[gtype.upper()] in types


def test_streamed_write_holds_about_one_tensor(tmp_path: Path) -> None:
    base = _model(tmp_path, "llama", num_hidden_layers=8)
    loaded = load_model(base)
    load_adapter(loaded.model, tmp_path / "ad")
    cfg = loaded.model.config
    vocab = vocab_kvs(loaded, cfg.vocab_size)
    lazy = merged_tensors(loaded.model)
    sizes = [4 * torch.Size(shape).numel() for shape, _ in lazy.values()]  # float32 bytes
    f16 = sum(2 * torch.Size(shape).numel() for shape, _ in lazy.values() if len(shape) == 2)
    out = tmp_path / "m.gguf"
    got = _measured(lambda: gm.write_model_gguf(cfg, lazy, vocab, out, "f16", "m"))
    _, eager = _eager_file(base, tmp_path, "f16", measure=True)
    # as a tensor is written only its f16 bytes are live; the merge W + s·BA peaks at two
    # float32 temporaries of one weight (s·BA and the sum), freed before the next; besides
    # them only small arrays (llama3's rope_freqs, 64 bytes here) are live
    assert got["at_write"] <= max(sizes) // 2 + 1024, got
    assert got["torch_peak"] <= 2 * max(sizes), got
    # the eager writer held every f16 output (the 2-D weights; 1-D ones stay F32, views of the
    # model) at once: the sum, many times one tensor
    assert eager["at_write"] >= f16 > 10 * max(sizes), eager
    # and all the streamed write allocated at its worst moment, transients and Python objects
    # (gguf's tensor-name map, the packed keys) included, is under half of that
    assert got["peak"] < f16 // 2, (got, f16)


def _argv(base: Path, tmp: Path, out: Path) -> list[str]:
    return ["merge", "--model", str(base), "--adapter", str(tmp / "ad"), "--out", str(out)]


def test_interrupted_write_leaves_no_half_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _model(tmp_path, "qwen2")
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    out.write_bytes(b"the previous file")
    real, calls = gguf.GGUFWriter.write_tensor_data, []

    def dies_on_third(self, tensor, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", dies_on_third)
    assert main(_argv(base, tmp_path, out)) == 130  # Ctrl-C, as the CLI reports it
    assert out.read_bytes() == b"the previous file"  # the old file, whole
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]  # and no temp file left


def test_unwritable_or_full_output_fails_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    base = _model(tmp_path, "qwen2")
    (tmp_path / "file").write_text("x")
    _fails(_argv(base, tmp_path, tmp_path / "file" / "m.gguf"), capsys, "not a directory")

    def full(self, tensor, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
    (tmp_path / "out").mkdir()
    _fails(_argv(base, tmp_path, tmp_path / "out" / "m.gguf"), capsys, "No space left")
    assert not list((tmp_path / "out").iterdir())
