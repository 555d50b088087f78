"""Checkpoint offload: same gradients from memory, host or disk; the temp dir never outlives a
step; a failing disk is one clear error, or a fallback to memory when allowed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from mesp.engines import make_engine
from mesp.engines.offload import CheckpointStore
from mesp.errors import MespError
from tests.engine_cases import grads_of, model_with_adapter, padded_batch


@pytest.mark.parametrize("engine", ["mesp", "mebp"])
@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_offload_gives_identical_gradients(engine: str, mode: str, tmp_path: Path) -> None:
    model = model_with_adapter("gemma3")
    batch = padded_batch()
    ref = grads_of(make_engine(engine), model, batch)
    got = grads_of(make_engine(engine, offload=mode, offload_dir=str(tmp_path)), model, batch)
    assert ref[0] == got[0]
    for k in ref[1]:
        assert torch.equal(ref[1][k], got[1][k]), k
    assert list(tmp_path.iterdir()) == []  # the offload directory is gone after the step


def test_disk_store_roundtrip_and_cleanup_on_error(tmp_path: Path) -> None:
    ts = [torch.randn(2, 5, 7, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointStore("disk", str(tmp_path)) as store:
            for i, t in enumerate(ts):
                store.put(i, t)
            store.prefetch(2)
            for i in (2, 1, 0):
                assert torch.equal(store.pop(i), ts[i])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = os.pwrite

    def pwrite(fd: int, data: object, off: int) -> int:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, off)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", pwrite)


def test_full_disk_is_an_error_unless_fallback_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_with_adapter("llama")
    batch = padded_batch()
    ref = grads_of(make_engine("mesp"), model, batch)
    _full_disk(monkeypatch)
    with pytest.raises(MespError, match="No space left.*--offload-fallback"):
        grads_of(make_engine("mesp", offload="disk", offload_dir=str(tmp_path)), model, batch)
    assert list(tmp_path.iterdir()) == []
    _full_disk(monkeypatch)
    got = grads_of(
        make_engine("mesp", offload="disk", offload_dir=str(tmp_path), offload_fallback=True),
        model,
        batch,
    )
    for k in ref[1]:
        assert torch.equal(ref[1][k], got[1][k]), k


def test_unwritable_offload_dir() -> None:
    with pytest.raises(MespError, match="cannot create an offload file"):
        CheckpointStore("disk", "/proc/self/nope")


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_streamed_weights_same_gradients_and_model_restored(family: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--stream-weights: block weights on disk, loaded per block; gradients unchanged (bitwise),
    evaluation through the hooks still works, close() restores the model, the file goes."""
    from mesp.quant import QuantSpec

    model = model_with_adapter(family, QuantSpec(4, 32))
    batch = padded_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref_logits = model(batch.input_ids)
    ref = grads_of(make_engine("mesp"), model, batch)
    engine = make_engine("mesp", stream_weights=True, offload_dir=str(tmp_path))
    for _ in range(2):  # the second step reuses the stream
        got = grads_of(engine, model, batch)
        assert got[0] == ref[0]
        for k in ref[1]:
            assert torch.equal(ref[1][k], got[1][k]), k
    ws = engine.attach(model)
    assert ws is not None and not ws.resident(0) and len(list(tmp_path.iterdir())) == 1
    assert torch.equal(model(batch.input_ids), ref_logits)  # hooks load, then release
    assert not ws.resident(0)
    ws.close()
    assert not list(tmp_path.iterdir())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
