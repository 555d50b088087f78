"""LoRA adapters round-trip with HF PEFT in both directions, and merge is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesp.errors import MespError
from mesp.lora import LoraConfig, apply_lora, load_adapter, merge_lora, save_adapter
from tests.hf_tiny import FAMILIES, hf_model, lora_names, mesp_from_hf

IDS = torch.randint(0, 211, (2, 13), generator=torch.Generator().manual_seed(3))


def _randomize(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("family", FAMILIES)
def test_mesp_adapter_loads_in_peft(family: str, tmp_path: Path) -> None:
    from peft import PeftModel

    hf = hf_model(family)
    ours = mesp_from_hf(hf)
    cfg = LoraConfig(rank=3, alpha=7.0)
    apply_lora(ours, cfg)
    _randomize(ours.lora_parameters(), 1)
    save_adapter(ours, tmp_path / "ad", cfg)
    peft = PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), peft(IDS).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_loads_in_mesp(family: str, tmp_path: Path) -> None:
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model

    hf = hf_model(family)
    base = mesp_from_hf(hf)
    targets = lora_names(family, ["q_proj", "v_proj", "down_proj"])  # Phi-3: qkv_proj
    peft = get_peft_model(hf, PeftConfig(r=4, lora_alpha=12, target_modules=targets))
    _randomize([p for n, p in peft.named_parameters() if "lora_" in n], 2)
    peft.save_pretrained(str(tmp_path / "pa"))
    cfg = load_adapter(base, tmp_path / "pa")
    assert cfg.rank == 4 and cfg.lora_scale == pytest.approx(3.0)
    assert set(cfg.targets) == set(targets)
    with torch.no_grad():
        torch.testing.assert_close(base(IDS), peft.eval()(IDS).logits, atol=1e-4, rtol=0)


def test_merge_equals_adapter() -> None:
    ours = mesp_from_hf(hf_model("qwen2"))
    apply_lora(ours, LoraConfig(rank=2, scale=20.0))
    _randomize(ours.lora_parameters(), 4)
    with torch.no_grad():
        before = ours(IDS)
        merge_lora(ours)
        assert not ours.lora_modules()
        torch.testing.assert_close(ours(IDS), before, atol=1e-4, rtol=0)


def test_init_is_kaiming_a_and_zero_b() -> None:
    ours = mesp_from_hf(hf_model("llama"))
    apply_lora(ours, LoraConfig(rank=8))
    q = ours.layers[0].self_attn.q_proj
    assert torch.count_nonzero(q.lora_B) == 0
    bound = 1 / q.in_features**0.5
    assert q.lora_A.abs().max() <= bound and q.lora_A.std() > bound / 3
    only = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert only and all("lora_" in n for n in only)


def test_adapter_for_another_model_is_rejected(tmp_path: Path) -> None:
    small = mesp_from_hf(hf_model("llama"))
    cfg = LoraConfig(rank=2)
    apply_lora(small, cfg)
    save_adapter(small, tmp_path / "ad", cfg)
    other = mesp_from_hf(hf_model("llama", hidden_size=48, head_dim=16))
    with pytest.raises(MespError, match="shape"):
        load_adapter(other, tmp_path / "ad")


def test_bad_lora_config() -> None:
    with pytest.raises(MespError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(MespError, match="target"):
        LoraConfig(targets=("qq_proj",))


@pytest.mark.parametrize(
    "conf,match",
    [('{"lora_alpha": 16}', 'integer "r"'), ("[1, 2]", 'integer "r"'), ("{nope", "unreadable")],
)
def test_bad_adapter_config_is_one_line(tmp_path: Path, conf: str, match: str) -> None:
    model = mesp_from_hf(hf_model("llama"))
    cfg = LoraConfig(rank=2)
    apply_lora(model, cfg)
    save_adapter(model, tmp_path / "ad", cfg)
    (tmp_path / "ad" / "adapter_config.json").write_text(conf)
    fresh = mesp_from_hf(hf_model("llama"))
    with pytest.raises(MespError, match=match) as e:
        load_adapter(fresh, tmp_path / "ad")
    assert "\n" not in str(e.value)
