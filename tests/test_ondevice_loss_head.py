"""The ExecuTorch loss head: one program per vocabulary slice, called in a loop by both drivers.

Its planned memory is one slice's whatever the vocabulary (the issue's bound: the undelegated
whole-vocabulary program planned every slice at once when XNNPACK took it), and the loop
(loss_start, loss_slice per slice, loss_tail, loss_finish) equals the whole-head loss."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mesp.ondevice.artifact_files import Writer
from mesp.ondevice.edge_programs import EdgeSpec, loss_and_grad
from mesp.ondevice.export_et import _loss_programs, _Programs
from mesp.ondevice.programs import WeightSpec
from mesp.quant import QuantSpec, packed_bytes, quantize

H, B, S, CHUNK = 64, 2, 8, 128
Q = QuantSpec(4, 32)


def _head(vocab: int, quant: bool, softcap: float | None = None) -> tuple[EdgeSpec, dict]:
    g = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, H, generator=g) * 0.2
    ws = WeightSpec("lm_head", Q if quant else None, core_aten=True)
    es = EdgeSpec(ws, ws, torch.float32, None, 1e-6, 0.0, softcap, CHUNK, vocab)
    tensors = {"norm.weight": 1 + 0.1 * torch.randn(H, generator=g)}
    if quant:
        wq, sc, bi = quantize(w, Q)
        tensors.update({"lm_head.weight": packed_bytes(wq), "lm_head.scales": sc})
        tensors["lm_head.biases"] = bi
    else:
        tensors["lm_head.weight"] = w
    return es, tensors


def _planned(tmp: Path, vocab: int) -> dict[str, int]:
    es, w = _head(vocab, quant=True)
    progs = _Programs(Writer(tmp / f"v{vocab}"), delegate=True)
    sec = _loss_programs(progs, es, w, torch.randn(B, S, H), B * S)
    assert (sec["vocab"], sec["chunk"], sec["head_prefix"]) == (vocab, CHUNK, "lm_head")
    return {n: sum(r["planned_bytes"]) for n, r in progs.rows.items()}


@pytest.mark.slow
def test_planned_memory_is_one_slice_whatever_the_vocabulary(tmp_path: Path) -> None:
    """Two vocabularies 8x apart, the same slice: every loss program plans the same bytes,
    and the slice program (the one that sees head rows) is delegated."""
    small, large = _planned(tmp_path, 4 * CHUNK), _planned(tmp_path, 32 * CHUNK)
    assert set(small) == set(large) == {"loss_start", "loss_slice", "loss_finish"}
    assert small == large, (small, large)
    tail = _planned(tmp_path, 32 * CHUNK + 40)  # a shorter last slice: its own program
    assert tail["loss_tail"] <= tail["loss_slice"] == small["loss_slice"]


@pytest.mark.parametrize("quant", [True, False])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_sliced_loop_equals_the_whole_head(quant: bool, softcap: float | None) -> None:
    """start + slices (a tail included) + finish, as the drivers run them, against the whole
    head's logsumexp and softmax gradient: losses and dh to fp32 rounding."""
    vocab = 3 * CHUNK + 40
    es, w = _head(vocab, quant, softcap)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, S, H, generator=g, dtype=torch.float64).float()
    ids = torch.tensor([0, 3, 5, 9, 15])
    tgt = torch.tensor([0, CHUNK - 1, CHUNK, 3 * CHUNK + 7, vocab - 1])  # slice edges, the tail
    norm = torch.tensor(float(len(ids)))
    loss, dh = loss_and_grad(es, w, h, ids, tgt, norm)
    ref_loss, ref_dh = loss_and_grad(replace(es, vocab_chunk=None), w, h, ids, tgt, norm)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-4, atol=1e-6)
    assert dh.reshape(B * S, H)[ids].abs().sum() > 0
    untrained = torch.ones(B * S, dtype=torch.bool).index_fill_(0, ids, False)
    assert dh.reshape(B * S, H)[untrained].abs().max() == 0  # only trained rows carry a gradient
