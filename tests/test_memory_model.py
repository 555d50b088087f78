"""The analytic memory model against the exact live-tensor tracker on real training steps, and
the planner built on it."""

from __future__ import annotations

import pytest
import torch

from mesp.batch import Batch
from mesp.config import ModelConfig
from mesp.engines import make_engine
from mesp.errors import MespError
from mesp.loading import random_model
from mesp.loading.info import weight_bytes
from mesp.loading.zoo import SHAPES
from mesp.lora import LoraConfig, apply_lora
from mesp.memory.model import ENGINES, analytic_floor, predict
from mesp.memory.plan import FAMILY_SIZES, Run, largest_model, longest_seq, shape_config
from mesp.memory.tracker import adapter_tensors, measure_peak
from mesp.models.transformer import LORA_TARGETS
from mesp.quant import QuantSpec
from mesp.training.schedule import make_optimizer

Q4 = QuantSpec(4, 64)


def small_config(family: str, **over: object) -> ModelConfig:
    """Small but not tiny: hidden 256, 4 layers, vocabulary 4096; every input size a multiple
    of the quantization group, so a quantized base is quantized throughout."""
    d = dict(
        model_type={"gemma3": "gemma3_text"}.get(family, family),
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=4096,
        tie_word_embeddings=family in ("qwen2", "gemma3", "gemma2"),
        max_position_embeddings=4096,
    )
    if family == "gemma3":  # a window shorter than the longer sequence: the mask path runs
        d.update(sliding_window=128, query_pre_attn_scalar=64, sliding_window_pattern=2)
    if family == "gemma2":  # alternating window, both soft-caps (the chunked attention runs)
        d.update(
            sliding_window=128,
            query_pre_attn_scalar=64,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    d.update(over)
    return ModelConfig.from_hf(d)


def measure(
    cfg: ModelConfig,
    engine: str,
    seq: int,
    quant: QuantSpec | None,
    dtype: torch.dtype = torch.float32,
    batch: int = 2,
    optimizer: str = "adamw",
    keep_tapes: int = 0,
) -> dict[str, int]:
    """Peak of one trainer iteration (engine step, optimizer step, zero_grad) after a warm-up
    iteration that creates the optimizer state."""
    model = random_model(cfg, quant, dtype)
    apply_lora(model, LoraConfig(rank=8))
    params = model.lora_parameters()
    eng = make_engine(engine, **({"keep_tapes": keep_tapes} if keep_tapes else {}))
    opt = make_optimizer(params, optimizer, 1e-4, 0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    b = Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.ones(batch, seq).bool())

    def step() -> None:
        eng.step(model, b, b.n_tokens)
        if not getattr(eng, "updates_params", False):
            opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return measure_peak(
        step, weights=list(model.buffers()), adapter=lambda: adapter_tensors(params, opt)
    )


def check(
    family: str, engine: str, seq: int, quant: QuantSpec | None, **kw: object
) -> tuple[int, int]:
    cfg = small_config(family, **kw.pop("over", {}))  # type: ignore[arg-type]
    got = measure(cfg, engine, seq, quant, **kw)  # type: ignore[arg-type]
    dtype = kw.get("dtype", torch.float32)
    opt = kw.get("optimizer", "adamw")
    keep = kw.get("keep_tapes", 0)
    p = predict(
        cfg,
        engine,
        seq,
        kw.get("batch", 2),
        8,
        quant=quant,
        dtype=dtype,
        optimizer=opt,
        keep_tapes=keep,
    )  # type: ignore[arg-type]
    assert p["weights"] == got["weights"]  # weights are counted, not modelled
    parts = ("weights", "adapter", "optimizer", "grads_at_peak", "checkpoints", "working", "logits")
    assert sum(int(p[k]) for k in parts) == p["total"]  # the table's columns add up
    # the whole peak, and the part the model really predicts (all but the weights)
    assert abs(p["total"] / got["total"] - 1) <= 0.10, (p, got)
    over, got_over = p["total"] - got["weights"], got["total"] - got["weights"]
    assert abs(over / got_over - 1) <= 0.10, (p["peak_at"], over, got_over)
    return int(p["total"]), got["total"]


# Each engine sees both families, both lengths, and a dense and a quantized base: 16 cases.
# The four that run by default cover every engine, family, length and base once; the rest are
# slow (a tracked step of bp costs several seconds).
FAST = {
    ("bp", "qwen2", 64),
    ("mebp", "gemma3", 64),
    ("mesp", "qwen2", 256),
    ("mezo", "gemma3", 256),
}
CASES = [
    pytest.param(
        engine,
        family,
        seq,
        Q4 if (family, seq) in {("qwen2", 256), ("gemma3", 64)} else None,
        id=f"{engine}-{family}-{seq}",
        marks=() if (engine, family, seq) in FAST else pytest.mark.slow,
    )
    for engine in ("bp", "mebp", "mesp", "mezo")
    for family in ("qwen2", "gemma3")
    for seq in (64, 256)
]


@pytest.mark.parametrize("engine,family,seq,quant", CASES)
def test_predicted_peak_matches_measured(
    engine: str, family: str, seq: int, quant: QuantSpec | None
) -> None:
    check(family, engine, seq, quant)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["bp", "mebp", "mesp", "mezo"])
@pytest.mark.parametrize(
    "family,kw",
    [
        ("qwen2", {"dtype": torch.bfloat16}),
        ("gemma3", {"dtype": torch.bfloat16, "optimizer": "sgd"}),
        ("llama", {"batch": 1}),
        ("qwen3", {}),
        ("qwen2", {"over": {"vocab_size": 20000}}),  # CE in vocabulary slices
        ("llama", {"over": {"vocab_size": 512, "intermediate_size": 1536}}),  # block-bound
        ("olmo2", {"dtype": torch.bfloat16}),
        ("gemma2", {"dtype": torch.bfloat16, "over": {"vocab_size": 512}}),  # capped attention
    ],
    ids=[
        "qwen2-bf16",
        "gemma3-bf16-sgd",
        "llama-b1",
        "qwen3",
        "qwen2-v20k",
        "llama-wide",
        "olmo2-bf16",
        "gemma2-bf16-v512",
    ],
)
def test_predicted_peak_more_shapes(engine: str, family: str, kw: dict, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The model counts what a bf16 GEMM holds; on CPUs without one, the transient fp32 copies
    # of mesp.ops.matmul (about 4 MiB blocks) come on top and are not modelled: measure the
    # native-kernel path here.
    monkeypatch.setenv("MESP_BF16_MATMUL", "native")
    check(family, engine, 256, Q4, **dict(kw))


# OLMo 2 (post norms: its tape holds a and d, n1 is x and n2 is x2) and Gemma 2 (the chunked
# attention's per-chunk scores under the soft-cap; the capped loss head's second logits block):
# each engine loss-head-bound (vocabulary 4096) and block-bound (vocabulary 512, where the
# attention backward's score blocks are the peak at 640 positions). Three run by default.
NEW_FAST = {("mesp", "gemma2", 640), ("mezo", "gemma2", 256), ("mebp", "olmo2", 640)}
NEW_CASES = [
    pytest.param(
        engine,
        family,
        seq,
        {"vocab_size": 512} if seq == 640 else {},
        id=f"{engine}-{family}-{seq}",
        marks=() if (engine, family, seq) in NEW_FAST else pytest.mark.slow,
    )
    for engine in ENGINES
    for family in ("olmo2", "gemma2")
    for seq in (256, 640)
]


@pytest.mark.parametrize("engine,family,seq,over", NEW_CASES)
def test_predicted_peak_olmo2_gemma2(engine: str, family: str, seq: int, over: dict) -> None:
    check(family, engine, seq, None if seq == 640 else Q4, over=over, optimizer="sgd")


# Phi-3 (fused qkv_proj and gate_up_proj: one adapter each, [dq | dk | dv] and [dgate | dup]
# concatenated in mesp's backward, gate | up one tensor): the same eight cases, two by default
PHI3_FAST = {("mesp", 640), ("mezo", 256)}
PHI3_CASES = [
    pytest.param(
        engine,
        seq,
        id=f"{engine}-phi3-{seq}",
        marks=() if (engine, seq) in PHI3_FAST else pytest.mark.slow,
    )
    for engine in ENGINES
    for seq in (256, 640)
]


@pytest.mark.parametrize("engine,seq", PHI3_CASES)
def test_predicted_peak_phi3(engine: str, seq: int) -> None:
    over = {"vocab_size": 512} if seq == 640 else {}
    check("phi3", engine, seq, None if seq == 640 else Q4, over=over, optimizer="sgd")


def test_capped_attention_is_counted() -> None:
    """Gemma 2's soft-capped attention never takes the flash kernels: no additive window mask,
    but per-chunk scores, so its block backward is above the same shape's without the cap."""
    cfg = small_config("gemma2", vocab_size=512)
    plain = small_config("gemma2", vocab_size=512, attn_logit_softcapping=None)
    capped, flash = (predict(c, "mesp", 640, 2)["phase:block backward"] for c in (cfg, plain))
    assert int(capped) > int(flash)


def test_engines_order_and_floor() -> None:
    cfg = shape_config("qwen2.5-0.5b")
    tot = {e: int(predict(cfg, e, 256, 1, quant=Q4)["total"]) for e in ("bp", "mebp", "mesp")}
    assert tot["mesp"] < tot["mebp"] < tot["bp"]
    floors = [
        analytic_floor(cfg, 256, 1, 8, t, Q4, torch.float32)
        for t in [(), ("q_proj", "v_proj"), LORA_TARGETS]
    ]
    assert 0 < floors[0] < floors[1] < floors[2]
    # a sum of parts (block working set + a CE chunk): near mesp's own peak, far below mebp's
    sgd = {e: predict(cfg, e, 256, 1, quant=Q4, optimizer="sgd") for e in tot}
    over = {e: int(p["total"]) - int(p["weights"]) for e, p in sgd.items()}
    assert 0.8 * over["mesp"] < floors[2] < 1.2 * over["mesp"] < over["mebp"]


def test_largest_model_and_longest_seq() -> None:
    run = Run(seq_len=256, quant=Q4, optimizer="sgd")
    ladder = FAMILY_SIZES["qwen2"]
    small = int(run.predict(shape_config(ladder[0]), "mesp")["total"])
    nxt = int(run.predict(shape_config(ladder[1]), "mesp")["total"])
    res = largest_model((small + nxt) // 2, ladder, "mesp", run)
    assert res["largest"] == ladder[0] and [r["fits"] for r in res["rows"]][:2] == [True, False]
    assert largest_model(small - 1, ladder, "mesp", run)["largest"] is None
    cfg = shape_config("qwen2.5-0.5b")
    budget = int(1.2 * small)
    n = longest_seq(budget, cfg, "mesp", run)
    assert 256 < n < cfg.max_position_embeddings
    assert int(run.predict(cfg, "mesp", n)["total"]) <= budget
    assert int(run.predict(cfg, "mesp", n + 1)["total"]) > budget
    assert longest_seq(10**6, cfg, "mesp", run) == 0


def test_every_ladder_shape_resolves_and_bad_input() -> None:
    for names in FAMILY_SIZES.values():
        for name in names:
            assert shape_config(name).num_hidden_layers > 0
    cfg = small_config("llama")
    with pytest.raises(MespError, match="engine"):
        predict(cfg, "zo", 64, 1)
    with pytest.raises(MespError, match="optimizer"):
        predict(cfg, "mesp", 64, 1, optimizer="lion")
    with pytest.raises(MespError, match="target"):
        predict(cfg, "mesp", 64, 1, targets=("qkv",))


@pytest.mark.parametrize(
    "engine,family",
    [("mesp", "qwen2"), ("mesp", "gemma3"), ("mebp", "qwen2"), ("mezo", "gemma3")],
)
def test_predicted_peak_with_the_tiled_mlp(engine: str, family: str) -> None:
    """Batch 2 × 640 tokens > MLP.tile: no-grad passes run the MLP in tiles (and mesp's hand
    backward recomputes gate/up per tile); the model follows."""
    check(family, engine, 640, Q4, optimizer="sgd")


@pytest.mark.parametrize(
    "family,seq,quant,keep",
    [("qwen2", 256, Q4, 4), ("gemma3", 64, None, 2), ("llama", 640, Q4, 3)],
    ids=["qwen2-256-all", "gemma3-64-half", "llama-640-tiled"],
)
def test_predicted_peak_with_kept_tapes(
    family: str, seq: int, quant: QuantSpec | None, keep: int
) -> None:
    """Budget-aware recompute: mesp keeping the last `keep` of 4 tapes, within the same ±10%;
    and the kept tapes cost what the model says beyond plain mesp's peak."""
    kept, _ = check(family, "mesp", seq, quant, optimizer="sgd", keep_tapes=keep)
    plain = predict(small_config(family), "mesp", seq, 2, quant=quant, optimizer="sgd")
    assert int(plain["total"]) < kept


# Published parameter counts: the model cards' figures (Qwen2.5, Qwen3: "Number of
# Parameters"; SmolLM2, Llama 3.x, Gemma 3 270M/1B: the size in the name or card). Gemma 3
# 4B/12B/27B are image-text models; their published 4.3B/12.2B/27.4B include the 417M SigLIP
# vision encoder (Gemma 3 technical report, table 1), which a text-only config does not have.
VISION = 0.417e9
PUBLISHED = {
    "qwen2.5-0.5b": 0.49e9,
    "qwen2.5-1.5b": 1.54e9,
    "qwen2.5-3b": 3.09e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-14b": 14.7e9,
    "qwen2.5-32b": 32.5e9,
    "qwen3-0.6b": 0.6e9,
    "qwen3-1.7b": 1.7e9,
    "qwen3-4b": 4.0e9,
    "qwen3-8b": 8.2e9,
    "qwen3-14b": 14.8e9,
    "qwen3-32b": 32.8e9,
    "smollm2-135m": 135e6,
    "smollm2-360m": 360e6,
    "smollm2-1.7b": 1.7e9,
    "llama-3.2-1b": 1.24e9,
    "llama-3.2-3b": 3.21e9,
    "llama-3.1-8b": 8.03e9,
    "gemma3-270m": 270e6,
    "gemma3-1b": 1.0e9,
    "gemma3-4b": 4.3e9 - VISION,
    "gemma3-12b": 12.2e9 - VISION,
    "gemma3-27b": 27.4e9 - VISION,
    "mistral-7b-v0.3": 7.25e9,  # the model page's count
    "smollm3-3b": 3.08e9,
    "granite-3.1-2b": 2.53e9,
    "olmo2-7b": 7.30e9,  # the model page's count
    "gemma2-2b": 2.61e9,  # the model page's count (tied head counted once)
    "phi-3-mini": 3.82e9,  # the model page's count
    "phi-4-mini": 3.84e9,  # the model page's count (tied head counted once)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shape_parameter_counts_match_the_published_sizes(name: str) -> None:
    """Each named shape builds (on the meta device) to within 2% of its published size: the
    same count `mesp info random:NAME` prints."""
    params = weight_bytes(shape_config(name), None, torch.float32)["params"]
    assert abs(params / PUBLISHED[name] - 1) <= 0.02, (name, params)


def test_every_shape_is_published_and_on_a_ladder() -> None:
    ladders = {n for names in FAMILY_SIZES.values() for n in names}
    assert ladders == set(SHAPES) == set(PUBLISHED)
    for family, names in FAMILY_SIZES.items():  # smallest first, all of that family
        cfgs = [shape_config(n) for n in names]
        assert {c.family for c in cfgs} == {family}
        counts = [weight_bytes(c, None, torch.float32)["params"] for c in cfgs]
        assert counts == sorted(counts), family


def test_logits_are_the_loss_heads_part_of_the_peak() -> None:
    """bp and mebp peak in the full-vocabulary cross-entropy: their logits column is the (T, V)
    fp32 log-softmax and its gradients, most of the peak; mesp's chunked head keeps one logits
    block (whether that or a block backward is its peak depends on the shape), a small part of
    bp's. Every engine's columns add up to its peak."""
    cfg = shape_config("qwen2.5-0.5b")
    t, v = 256, cfg.vocab_size
    for eng in ENGINES:
        p = predict(cfg, eng, t, 1, quant=Q4, optimizer="sgd")
        parts = ("weights", "adapter", "optimizer", "grads_at_peak", "checkpoints", "working")
        assert sum(int(p[k]) for k in parts) + int(p["logits"]) == p["total"]
        assert p["logits"] == (p["loss_head"] if p["peak_at"] == "cross-entropy" else 0)
        if eng in ("bp", "mebp"):
            assert p["peak_at"] == "cross-entropy" and int(p["logits"]) >= 3 * t * v * 4
    ms, bp = (predict(cfg, e, t, 1, quant=Q4, optimizer="sgd") for e in ("mesp", "bp"))
    assert 10 * int(ms["logits"]) < int(bp["logits"]) and int(ms["loss_head"]) < t * v * 4


def test_the_budget_sets_how_many_tapes_mesp_keeps() -> None:
    """The planner keeps the largest k whose predicted peak fits TAPE_FILL of the budget; the
    training budget check gives the same k; no budget (or another engine) keeps none."""
    from mesp.data import DataConfig
    from mesp.loading.session import ModelOptions
    from mesp.memory.plan import TAPE_FILL, kept_tapes, plan
    from mesp.training.budget import budget_tapes, check_budget
    from mesp.training.config import TrainConfig

    cfg = shape_config("qwen2.5-0.5b")
    run = Run(seq_len=256, quant=Q4, optimizer="sgd")
    plain = int(run.predict(cfg, "mesp")["total"])
    assert kept_tapes(10**12, cfg, run) == cfg.num_hidden_layers
    assert kept_tapes(plain, cfg, run) == 0  # plain mesp fits, but not within TAPE_FILL
    budget = int(1.5 * plain)
    k = kept_tapes(budget, cfg, run)
    assert 0 < k < cfg.num_hidden_layers
    assert int(run.predict(cfg, "mesp", keep_tapes=k)["total"]) <= TAPE_FILL * budget
    assert int(run.predict(cfg, "mesp", keep_tapes=k + 1)["total"]) > TAPE_FILL * budget
    bt = plan(budget, cfg, "qwen2.5-0.5b", run)["engines"]["mesp"]["budget_tapes"]
    assert bt == {"kept": k, "layers": 24, "total": run.predict(cfg, "mesp", keep_tapes=k)["total"]}

    opts = ModelOptions(model="random:qwen2.5-0.5b", quantize="4")
    data, train = DataConfig(seq_len=256), TrainConfig(batch_size=1, optimizer="sgd")
    lora = LoraConfig(rank=8)
    mem = f"{budget}B"
    got = check_budget(mem, opts, "mesp", data, lora, train)
    assert budget_tapes(got, opts, "mesp", data, lora, train) == k
    assert budget_tapes(None, opts, "mesp", data, lora, train) == 0
    assert budget_tapes(got, opts, "mebp", data, lora, train) == 0
    with pytest.raises(MespError, match="mesp"):
        predict(cfg, "mebp", 256, 1, keep_tapes=2)


def test_measured_mesp_peak_below_mebp() -> None:
    """Measured, not modelled: where a block's working set matters (8 layers, 256 positions,
    4-bit), mesp's peak is below mebp's. (`mesp bench quick`'s tiny shape is head-bound, and
    there the two sit within a few percent of each other.)"""
    cfg = small_config("qwen2", over={"num_hidden_layers": 8})
    got = {e: measure(cfg, e, 256, Q4)["total"] for e in ("mebp", "mesp")}
    assert got["mesp"] < 0.95 * got["mebp"], got
