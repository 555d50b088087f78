"""mesp.nn's autograd Functions against float64 gradcheck, and mesp.patch on transformers + PEFT:
same loss and gradients as the unpatched model, exact unpatch, same adapter files, same Trainer
losses. Tiny models from tests/hf_tiny.py: transformers + PEFT is the oracle."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import gradcheck

from mesp.models.linear import FrozenWeight
from mesp.nn import ChunkedLMHeadLoss, StructuredLoRALinear
from mesp.nn.functions import (
    Proj,
    linear_cross_entropy,
    lora_gated_mlp,
    lora_linear,
    lora_shared_input,
)
from mesp.patch import patch, patch_record, unpatch
from mesp.quant import QuantSpec
from tests.hf_tiny import FAMILIES, LATER, hf_model, lora_names, n_patched

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' renames
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def r(*shape: int, seed: int, grad: bool = True) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * 0.5).requires_grad_(grad)


# ---- the Functions, float64 gradcheck ----


def test_gradcheck_lora_linear() -> None:
    x, w, b, A, B = (
        r(2, 3, 8, seed=0),
        r(5, 8, seed=1, grad=False),
        r(5, seed=2),
        r(2, 8, seed=3),
        r(5, 2, seed=4),
    )
    assert gradcheck(lambda x, b, A, B: lora_linear(x, Proj(w, b, A, B, 1.7)), (x, b, A, B))


def test_gradcheck_lora_linear_packed_base() -> None:
    fw = FrozenWeight(4, 32, F64)
    fw.set_dense(r(4, 32, seed=5, grad=False).detach(), QuantSpec(4, 32))
    x, A, B = r(2, 32, seed=6), r(2, 32, seed=7), r(4, 2, seed=8)
    assert gradcheck(lambda x, A, B: lora_linear(x, Proj(fw, None, A, B, 0.5)), (x, A, B))
    # forward is the dequantized base's
    torch.testing.assert_close(lora_linear(x, Proj(fw)), x @ fw.dense(F64).t())


def test_gradcheck_shared_input_qkv() -> None:
    x, bq = r(2, 3, 8, seed=0), r(6, seed=1)
    wq, wk, wv = (r(n, 8, seed=s, grad=False) for n, s in ((6, 2), (3, 3), (3, 4)))
    Aq, Bq, Ak, Bk = r(2, 8, seed=5), r(6, 2, seed=6), r(2, 8, seed=7), r(3, 2, seed=8)

    def f(x: Tensor, bq: Tensor, Aq: Tensor, Bq: Tensor, Ak: Tensor, Bk: Tensor) -> Any:
        # v has no adapter: a frozen projection in the same node
        return lora_shared_input(
            x, [Proj(wq, bq, Aq, Bq, 2.0), Proj(wk, None, Ak, Bk, 0.3), Proj(wv)]
        )

    assert gradcheck(f, (x, bq, Aq, Bq, Ak, Bk))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("recompute", [False, True])
def test_gradcheck_gated_mlp(act: str, recompute: bool) -> None:
    x = r(2, 3, 8, seed=0)
    wg, wu, wd = (
        r(7, 8, seed=1, grad=False),
        r(7, 8, seed=2, grad=False),
        r(8, 7, seed=3, grad=False),
    )
    ad = [
        r(2, 8, seed=4),
        r(7, 2, seed=5),
        r(2, 8, seed=6),
        r(7, 2, seed=7),
        r(2, 7, seed=8),
        r(8, 2, seed=9),
    ]

    def f(x: Tensor, *t: Tensor) -> Tensor:
        g, u, d = (
            Proj(wg, None, t[0], t[1], 2.0),
            Proj(wu, None, t[2], t[3], 0.5),
            Proj(wd, None, t[4], t[5]),
        )
        return lora_gated_mlp(x, g, u, d, act, recompute)

    assert gradcheck(f, (x, *ad))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_linear_cross_entropy(softcap: float | None) -> None:
    x, head = r(2, 5, 8, seed=0), r(11, 8, seed=1, grad=False)
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    labels[0, 1] = labels[1, 3] = -100
    for kw in ({}, {"shift": True, "vocab_chunk": 4, "num_items": 7}):

        def f(x: Tensor, kw: dict = kw) -> Tensor:
            return linear_cross_entropy(x, head, labels, softcap=softcap, chunk_rows=2, **kw)

        assert gradcheck(f, (x,))
    # value: HF's shifted, masked mean cross-entropy of the full logits
    z = x @ head.t()
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(z[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    got = linear_cross_entropy(x, head, labels, softcap=softcap, shift=True)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    lm_head = nn.Linear(8, 11, bias=False, dtype=F64).requires_grad_(False)
    lm_head.weight.copy_(head)
    torch.testing.assert_close(
        ChunkedLMHeadLoss(lm_head, softcap)(x, labels), ref, rtol=1e-12, atol=0
    )


def test_wrap_starts_at_the_base() -> None:
    base = nn.Linear(8, 5, dtype=F64)
    layer = StructuredLoRALinear.wrap(base, rank=3, alpha=6.0)
    x = r(4, 8, seed=0)
    torch.testing.assert_close(layer(x), base(x))
    assert not base.weight.requires_grad and layer.scaling == 2.0
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {
        "lora_A.default.weight",
        "lora_B.default.weight",
    }


def saved_by(fn: Any, *args: Any) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd keeps for backward while fn runs."""
    shapes: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return shapes


def test_saved_tensors_are_only_what_backward_needs() -> None:
    """x and the adapters, never a (dequantized) base weight, h, or act(gate)·up."""
    fw = FrozenWeight(12, 32, F64)
    fw.set_dense(r(12, 32, seed=1, grad=False).detach(), QuantSpec(4, 32))
    layer = StructuredLoRALinear.wrap(fw, rank=2, alpha=4.0)
    x = r(5, 32, seed=2)
    assert sorted(saved_by(layer, x)) == [(2, 32), (5, 32), (12, 2)]  # A, x, B
    up, down = r(12, 32, seed=3, grad=False), r(32, 12, seed=4, grad=False)
    g, u, d = Proj(fw), Proj(up), Proj(down)
    assert sorted(saved_by(lora_gated_mlp, x, g, u, d, "silu")) == [(5, 12), (5, 12), (5, 32)]
    assert saved_by(lora_gated_mlp, x, g, u, d, "silu", True) == [(5, 32)]
    labels = torch.randint(0, 12, (5,))
    assert saved_by(linear_cross_entropy, x, up, labels) == [(5, 32)]  # dh, formed in forward


def test_fused_projections_match_separate_layers() -> None:
    from mesp.nn import FusedLoRAProjections

    layers = {
        n: StructuredLoRALinear.wrap(nn.Linear(8, o, dtype=F64), 2, 4.0)
        for n, o in (("q", 6), ("k", 3), ("v", 3))
    }
    with torch.no_grad():
        for layer in layers.values():
            layer.lora_B.default.weight.normal_()
    fused = FusedLoRAProjections(layers)
    x = r(2, 4, 8, seed=0)
    wrt = [x, *(p for p in fused.parameters() if p.requires_grad)]
    ref = [layer(x) for layer in layers.values()]
    ref_g = torch.autograd.grad(sum(o.square().sum() for o in ref), wrt)
    got = fused(x)
    got_g = torch.autograd.grad(sum(o.square().sum() for o in got), wrt)
    for a, b in zip([*ref, *ref_g], [*got, *got_g], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- patch on transformers + PEFT ----


def peft_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    from peft import LoraConfig, get_peft_model

    targets = lora_names(family, TARGETS)  # Phi-3: its fused qkv_proj and gate_up_proj
    model = get_peft_model(
        hf_model(family, seed).to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # B = 0 would leave dA = 0: make every gradient non-trivial
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.train()


def batch(seed: int = 3) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    return ids, labels


def grads(model: nn.Module, ids: Tensor, labels: Tensor) -> tuple[float, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return float(out.loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def assert_same_grads(ref: dict[str, Tensor], got: dict[str, Tensor]) -> None:
    assert ref.keys() == got.keys() and ref
    for name, a in ref.items():
        a64, b64 = a.double().flatten(), got[name].double().flatten()
        assert float(F.cosine_similarity(a64, b64, 0)) >= 0.999999, name
        assert float((a64 - b64).abs().max() / a64.abs().max()) <= 1e-4, name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpointing", ["off", "non-reentrant", "reentrant"])
def test_patched_gradients_match(family: str, checkpointing: str) -> None:
    model = peft_model(family)
    if checkpointing != "off":
        kw = {"use_reentrant": checkpointing == "reentrant"}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    ids, labels = batch()
    loss0, g0 = grads(model, ids, labels)
    patch(model)
    assert len(patch_record(model).names) == 2 * n_patched(family)  # LoRA linears + MLP
    loss1, g1 = grads(model, ids, labels)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert_same_grads(g0, g1)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_logits_without_labels_and_none_with(family: str) -> None:
    model = peft_model(family).eval()
    ids, labels = batch()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        patch(model)
        torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
        out = model(input_ids=ids, labels=labels)
        assert out.logits is None and out.loss.ndim == 0
        loss, *_ = model(input_ids=ids, labels=labels, return_dict=False)
        assert float(loss) == pytest.approx(float(out.loss))


def test_unpatch_restores_every_module(tmp_path: Path) -> None:
    model = peft_model("qwen3")
    before = dict(model.named_modules())
    keys = list(model.state_dict())
    classes = {k: type(m) for k, m in before.items()}
    model.save_pretrained(str(tmp_path / "before"))
    patch(model)
    assert list(model.state_dict()) == keys  # names and order kept while patched
    model.save_pretrained(str(tmp_path / "patched"))
    unpatch(model)
    after = dict(model.named_modules())
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert all(type(m) is classes[k] for k, m in after.items())
    assert "forward" not in model.get_base_model().__dict__ and patch_record(model) is None

    from safetensors.torch import load_file

    a, b = (
        load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("before", "patched")
    )
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_peft_switches_still_work_while_patched() -> None:
    """PEFT's disable_adapter and merge still find the (re-classed) LoRA layers."""
    model = peft_model("llama").eval()
    ids, labels = batch()
    patch(model)
    with torch.no_grad():
        with model.disable_adapter():
            off = model(input_ids=ids, labels=labels).loss
        on = model(input_ids=ids, labels=labels).loss
        base = hf_model("llama")(input_ids=ids, labels=labels).loss
        merged = model.merge_and_unload()(input_ids=ids, labels=labels).loss
    assert float(off) == pytest.approx(float(base), rel=1e-6)
    assert float(merged) == pytest.approx(float(on), rel=1e-5) and abs(float(on - off)) > 1e-4


def test_plain_model_without_peft() -> None:
    """No adapter: the norms train; the fused MLP and loss head must pass dx through exactly."""
    model = hf_model("llama").train()
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    ids, labels = batch()
    loss0, g0 = grads(model, ids, labels)
    patch(model)
    assert patch_record(model).names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    loss1, g1 = grads(model, ids, labels)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert_same_grads(g0, g1)


def test_bf16_base_with_fp32_adapters() -> None:
    """PEFT's default on a bf16 model: fp32 adapters. Patched training stays close."""
    model = peft_model("qwen2", dtype=torch.bfloat16)
    lora_a = model.base_model.model.model.layers[0].mlp.up_proj.lora_A.default.weight
    assert lora_a.dtype == torch.float32
    ids, labels = batch()
    loss0, g0 = grads(model.train(), ids, labels)
    patch(model)
    loss1, g1 = grads(model, ids, labels)
    assert loss1 == pytest.approx(loss0, rel=1e-2)
    for name, a in g0.items():
        assert (
            float(F.cosine_similarity(a.double().flatten(), g1[name].double().flatten(), 0)) > 0.99
        )


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the patched model's paths ran: the patcher's lora_linear (PEFT layers) and
    linear_cross_entropy (the loss head), the modules' lora_gated_mlp (the fused MLP); counted
    where mesp.nn.patch and mesp.nn.modules look them up."""
    import importlib

    nn_mod = importlib.import_module("mesp.nn.modules")
    patch_mod = importlib.import_module("mesp.nn.patch")
    counts = {"lora_linear": 0, "linear_cross_entropy": 0, "lora_gated_mlp": 0}

    def counting(module: Any, name: str) -> None:
        fn = getattr(module, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            counts[name] += 1
            return fn(*a, **kw)

        monkeypatch.setattr(module, name, wrapper)

    counting(patch_mod, "lora_linear")
    counting(patch_mod, "linear_cross_entropy")
    counting(nn_mod, "lora_gated_mlp")
    return counts


@pytest.mark.parametrize(  # the Trainer takes ~15 s a case: the later families' in the slow suite
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in LATER else f for f in FAMILIES]
)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_losses_match(
    tmp_path: Path, checkpointing: bool, family: str, calls: dict[str, int]
) -> None:
    """20 optimizer steps of HF Trainer (AdamW, gradient accumulation 2: num_items_in_batch),
    and the patched run really went through mesp's functions, not PEFT's/HF's fallbacks."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(40):
        ids = torch.randint(0, 211, (11,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, 6, (), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})

    def run(patched: bool) -> list[float]:
        model = peft_model(family)
        if patched:
            patch(model)
        losses: list[float] = []

        class Recording(Trainer):
            def compute_loss(self, *a: Any, **kw: Any) -> Any:
                loss = super().compute_loss(*a, **kw)
                losses.append(float(loss.detach()))
                return loss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = TrainingArguments(
                output_dir=str(tmp_path / str(patched)),
                per_device_train_batch_size=2,
                gradient_accumulation_steps=2,
                max_steps=20,
                learning_rate=1e-3,
                gradient_checkpointing=checkpointing,
                report_to=[],
                save_strategy="no",
                logging_strategy="no",
                use_cpu=True,
                disable_tqdm=True,
                seed=0,
            )
            trainer = Recording(model=model, args=args, train_dataset=rows)
            trainer.train()
        if patched:  # still patched after Trainer's setup (checkpointing, PEFT hooks)
            rec = patch_record(trainer.model)
            assert rec is not None and rec.loss and not rec.skipped
            assert len(rec.names) == 2 * n_patched(family)  # LoRA linears + MLP
        return losses

    ref = run(False)
    assert calls == dict.fromkeys(calls, 0)  # the unpatched model never calls mesp
    got = run(True)
    assert len(ref) == 40
    # every micro-batch's loss came from the chunked head, every layer's MLP was fused, and every
    # LoRA projection ran lora_linear (twice per forward with checkpointing: the recompute)
    n_mlp = 2 * 40 * (2 if checkpointing else 1)
    assert calls["linear_cross_entropy"] == 40
    # (Phi-3's MLP stays transformers': its gate_up_proj and down_proj run lora_linear instead)
    assert calls["lora_gated_mlp"] == (n_mlp if family != "phi3" else 0)
    assert calls["lora_linear"] == 4 * n_mlp  # q, k, v, o (Phi-3: qkv, o, gate_up, down)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=1e-5)


def test_linear_cross_entropy_peak_has_no_head_placeholder() -> None:
    """A tensor head is wrapped as a FrozenWeight without allocating anything of its size: the
    exact tracker (which counts meta tensors too) must see only the chunk's logits and dh."""
    from mesp.memory.tracker import measure_peak

    V, D, N = 8192, 256, 8
    head = torch.randn(V, D) * 0.02
    h = torch.randn(1, N, D, requires_grad=True)
    labels = torch.randint(0, V, (1, N))

    def step() -> None:
        linear_cross_entropy(h, head, labels, shift=True).backward()

    step()  # h.grad exists before the measured step
    peak = measure_peak(step, weights=[head], adapter=lambda: [h, h.grad])
    assert peak["weights"] == V * D * 4
    # logits, softmax and dh of N rows: a few N × V blocks, far from the V × D head (8 MiB)
    assert peak["working"] < 8 * N * V * 4 < V * D * 4
    assert peak["total"] < 2 * V * D * 4
