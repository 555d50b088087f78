"""The CLI end to end on a tiny model directory: train, eval, generate, grad, info, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mesp.cli import main
from tests.tiny_dir import make_jsonl, make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("m") / "tiny", "qwen2")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_jsonl(tmp_path_factory.mktemp("d") / "train.jsonl")


COMMON = ["--quantize", "none", "--seq-len", "64", "--no-progress"]


LEAN = ["--stream-weights", "--offload", "disk", "--loss", "sampled-softmax", "--vocab-subset"]


@pytest.mark.parametrize(
    "engine,extra",
    [("mesp", []), ("mebp", []), ("mesp", [*LEAN, "40"])],
    ids=["mesp", "mebp", "mesp-lean"],
)
def test_train_lowers_loss_and_writes_peft_adapter(
    engine: str, extra: list[str], model_dir: Path, data: Path, tmp_path: Path
) -> None:
    """Every memory option at once (streamed weights, disk checkpoints, sampled softmax) still
    trains, and the adapter is a PEFT adapter either way."""
    out = tmp_path / "ad"
    rc = main(
        [
            "train",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "--engine",
            engine,
            "--steps",
            "30",
            "--batch-size",
            "4",
            "--lr",
            "1e-2",
            "--rank",
            "4",
            "--eval-every",
            "0",
            "--warmup",
            "0",
            "--adapter-out",
            str(out),
            "--mask-prompt",
            *COMMON,
            *extra,
        ]
    )
    assert rc == 0
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.15
    assert all(r["peak_rss_mb"] > 0 and r["tokens_per_s"] > 0 for r in log if "loss" in r)
    assert (out / "adapter_model.safetensors").exists() and (out / "loss.png").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["valid_ppl_after"] < summary["valid_ppl_before"]

    # The adapter loads in PEFT on the transformers model and gives our logits.
    import transformers as tf
    from peft import PeftModel

    from mesp.loading import load_model
    from mesp.lora import load_adapter

    hf = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, str(out)).eval()
    ours = load_model(model_dir).model
    load_adapter(ours, out)
    ids = torch.randint(0, 300, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), peft(ids).logits, atol=1e-4, rtol=0)


def test_grad_equals_hf_peft_autograd(model_dir: Path, data: Path, tmp_path: Path) -> None:
    """`mesp grad` (mesp engine) equals HF+PEFT autograd on the same adapter and batch."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from mesp.batch import collate
    from mesp.data import DataConfig, load_splits, pad_id_of
    from mesp.loading.tokenizer import Tokenizer

    hf = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft = get_peft_model(
        hf,
        LoraConfig(
            r=3,
            lora_alpha=5,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        ),
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft.save_pretrained(str(tmp_path / "pa"))
    out = tmp_path / "g.safetensors"
    assert (
        main(
            [
                "grad",
                "--model",
                str(model_dir),
                "--adapter",
                str(tmp_path / "pa"),
                "--data",
                str(data),
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--quantize",
                "none",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    ours = load_file(str(out))

    tok = Tokenizer.from_dir(model_dir)
    rows = load_splits(DataConfig(path=str(data), seq_len=32, valid_fraction=0.0), tok)["train"]
    batch = collate(rows[:2], pad_id_of(tok))
    logits = peft(batch.input_ids).logits
    tgt = torch.where(batch.mask, batch.targets, -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), tgt.reshape(-1))
    loss.backward()
    ref = {n.replace(".default", ""): p.grad for n, p in peft.named_parameters() if "lora_" in n}
    assert ref.keys() == ours.keys()
    a = torch.cat([ref[k].flatten() for k in ref]).double()
    b = torch.cat([ours[k].flatten() for k in ref]).double()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.999999


def test_eval_generate_info(model_dir: Path, data: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "eval",
                "--model",
                str(model_dir),
                "--data",
                str(data),
                "--seq-len",
                "32",
                "--quantize",
                "none",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] > 0 and res["ppl"] > 1
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                "To be",
                "--max-tokens",
                "5",
                "--quantize",
                "none",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                "To be",
                "--max-tokens",
                "5",
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--chat",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["info", "--model", str(model_dir)]) == 0
    assert "qwen2" in capsys.readouterr().out


def test_generate_with_cache_equals_full_forward(model_dir: Path) -> None:
    from mesp.inference.generate import generate
    from mesp.loading import load_model

    model = load_model(model_dir).model
    prompt = [5, 9, 33, 2]
    out = generate(model, prompt, max_tokens=6)
    ids = list(prompt)
    for _ in range(6):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt) :]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mesp.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_bad_inputs_give_one_line_and_no_adapter(model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    out = tmp_path / "ad"
    r = _run_cli(
        "train", "--model", str(model_dir), "--data", str(bad), "--adapter-out", str(out), *COMMON
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "adapter_model.safetensors").exists()
    cases = [
        ["train", "--model", str(tmp_path / "nope")],
        ["train", "--model", str(model_dir), "--rank", "0", *COMMON],
        ["train", "--model", str(model_dir), "--lr", "nan", *COMMON],
        ["train", "--model", str(model_dir), "--batch-size", "0", *COMMON],
        ["train", "--model", str(model_dir), "--seq-len", "100000", "--quantize", "none"],
        ["train", "--model", str(model_dir), "--adapter-out", str(bad), *COMMON],
        ["train", "--model", str(model_dir), "--data", str(tmp_path / "missing.jsonl"), *COMMON],
    ]
    for argv in cases:
        r = _run_cli(*argv)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (argv, r.stderr)
        assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("mesp: error:"), r.stderr
