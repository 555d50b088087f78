"""A k-quant GGUF trained on its codes at their own widths (issue 37): mesp writes a tiny model
as llama-quantize's q4_k_m / q5_k_m would (rows of 320 fall back to Q5_0 / Q5_1 and Q8_0), loads
it as stored, and every weight keeps its type's bits: Q4_K 4, Q5_0 / Q5_1 / Q5_K 5, Q6_K 6 (the
tied embedding and head too), Q8_0 8. The stored model trains exactly as the same weights
loaded dense, and its export (mesp's kernel ops at 5 and 6 bits, the embedding's integer
unpack) trains on ExecuTorch as the engine does."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from mesp.batch import Example, collate
from mesp.convert.gguf_model import write_model_gguf
from mesp.convert.gguf_vocab import vocab_kvs
from mesp.convert.merge import merged_tensors
from mesp.engines import make_engine
from mesp.loading import load_model
from mesp.loading.gguf import GGUFFile
from mesp.lora import LoraConfig, apply_lora
from mesp.models.linear import FrozenWeight
from mesp.models.transformer import CausalLM
from tests.tiny_dir import make_model_dir

# rows of 256 take the k-quants; the MLP's 320 (not a multiple of 256) takes their fallbacks
SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
SHAPE |= {"intermediate_size": 320, "num_hidden_layers": 3}
# per mix: (ggml type, bits, group) -> matrices, embedding included (3 layers: layer 2 gets more)
WANT = {
    "q4_k_m": {("Q4_K", 4, 32): 17, ("Q5_0", 5, 32): 2, ("Q6_K", 6, 16): 2, ("Q8_0", 8, 32): 1},
    "q5_k_m": {("Q5_K", 5, 32): 17, ("Q5_1", 5, 32): 2, ("Q6_K", 6, 16): 2, ("Q8_0", 8, 32): 1},
}
S, B, LR = 12, 2, 0.05


def _gguf(tmp_path: Path, mix: str) -> Path:
    loaded = load_model(make_model_dir(tmp_path / "base", "qwen2", **SHAPE))
    cfg, out = loaded.model.config, tmp_path / f"{mix}.gguf"
    write_model_gguf(cfg, merged_tensors(loaded.model), vocab_kvs(loaded, cfg.vocab_size), out,
                     mix, "b")  # fmt: skip
    return out


def _with_adapter(path: Path, stored: bool) -> CausalLM:
    model = load_model(path, keep_stored=stored).model
    apply_lora(model, LoraConfig(rank=3, alpha=7.0))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B nonzero too: every product of the step is exercised
        for p in model.lora_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _rows(n: int = 4) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 300, (S + 1,), generator=g).tolist() for _ in range(n)]
    return [(i, [0] * 4 + [1] * (S - 3)) for i in ids]


def _engine_run(model: CausalLM, rows: list, steps: int) -> list[float]:
    """The in-process mesp engine with torch's SGD, batches in the drivers' order."""
    eng, opt = make_engine("mesp"), torch.optim.SGD(model.lora_parameters(), lr=LR)
    losses = []
    for k in range(steps):
        batch = collate([Example(*rows[(k * B + j) % len(rows)]) for j in range(B)])
        losses.append(eng.step(model, batch, batch.n_tokens) / batch.n_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("mix", list(WANT))
def test_each_type_trains_at_its_width(tmp_path: Path, mix: str) -> None:
    path = _gguf(tmp_path, mix)
    stored, dense = _with_adapter(path, True), _with_adapter(path, False)
    held: Counter = Counter()
    with GGUFFile(path) as g:
        for name, mod in stored.named_modules():
            if isinstance(mod, FrozenWeight):
                q = mod.quant
                assert q is not None, name
                held[g.qtype(f"{name}.weight").name, q.bits, q.group_size] += 1
                codes = mod.out_features * mod.in_features * q.bits // 8
                assert mod.weight.numel() * 4 == codes, name  # the codes' bits, no container
    assert held == Counter(WANT[mix])
    rows = _rows()
    got, want = _engine_run(stored, rows, 3), _engine_run(dense, rows, 3)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-6, (got, want)
    for (n, p), q in zip(stored.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("mix", list(WANT))
def test_export_trains_on_executorch_like_the_engine(tmp_path: Path, mix: str) -> None:
    """Lowering takes about a minute and a half: two block structures (layer 2 has other types)."""
    pytest.importorskip("executorch")
    from mesp.ondevice import et_driver, runner
    from mesp.ondevice.export import ExportOptions, export_model
    from mesp.ops.gated_kernel import GATED_OPS
    from mesp.ops.qmatmul import KERNEL_OPS

    path = _gguf(tmp_path, mix)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opts = ExportOptions(S, B, 8192, target="executorch", attn_tile=4)
        conf = export_model(_with_adapter(path, True), tmp_path / "art", opts)
        # 5/6/8-bit blocks take the packed products, and every block the gated activation's
        assert conf["executorch"]["kernels"] == [*KERNEL_OPS, *GATED_OPS]
        assert len({b["fn"] for b in conf["blocks"]}) == 2
        rows = _rows()
        _, losses = et_driver.train(runner.Artifacts(tmp_path / "art"), rows,
                                    runner.RunConfig(3, LR, "sgd"))  # fmt: skip
        ref = _engine_run(_with_adapter(path, True), rows, 3)
    finally:
        torch.set_num_threads(n)
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= 1e-5, (losses, ref)
    assert losses[2] < losses[0]  # row 0 seen again is not worse: it trained
