"""Preference data and `mesp train|grad --objective dpo|orpo` end to end on a tiny model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from safetensors import safe_open

from mesp.cli import main
from mesp.data.preference import fit, load_pairs, parse_pair
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer
from mesp.training.checkpoint import load_state
from tests.tiny_dir import TEXT, make_model_dir, train_argv

LINES = sorted(set(TEXT))


def shuffled(line: str, seed: int) -> str:
    words = line.split()
    random.Random(seed).shuffle(words)
    return " ".join(words)


def write_pairs(path: Path, n: int = 40) -> Path:
    rows = [
        {
            "prompt": LINES[i % 5].split(",")[0],
            "chosen": " " + LINES[(i + 1) % 5],
            "rejected": " " + shuffled(LINES[(i + 1) % 5], i),
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("m") / "tiny", "qwen2")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_row_formats(tok: Tokenizer) -> None:
    p, c, r = parse_pair(
        {"prompt": "To be", "chosen": " or not", "rejected": " x"}, tok, None, "f:1"
    )
    assert p == tok.encode("To be") and c == tok.encode(" or not", add_bos=False) + [tok.eos_id]
    assert r[-1] == tok.eos_id
    chat = {
        "prompt": [{"role": "user", "content": "To be"}],
        "chosen": [{"role": "assistant", "content": "or not"}],
        "rejected": [{"role": "assistant", "content": "be to"}],
    }
    p, c, r = parse_pair(chat, tok, None, "f:2")
    assert tok.decode(p, skip_special=False) == "<|user|>To be<|end|><|assistant|>"
    assert tok.decode(c, skip_special=False) == "or not<|end|>"
    ids = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}
    assert parse_pair(ids, None, 300, "f:3") == [[1, 2], [3], [4, 5]]
    with pytest.raises(MespError, match=r"^f:4: .*outside the vocabulary"):
        parse_pair({**ids, "chosen_input_ids": [300]}, None, 300, "f:4")
    with pytest.raises(MespError, match=r"^f:5: not a preference row"):
        parse_pair({"prompt": "a", "completion": "b"}, tok, None, "f:5")


def test_truncation_is_prompt_first_and_errors_name_the_line(tmp_path: Path) -> None:
    assert fit([1, 2, 3, 4], [[5, 6], [7, 8, 9]], 5) == [[3, 4], [5, 6], [7, 8, 9]]
    assert fit([1, 2], [[5, 6, 7, 8, 9, 10]], 4) == [[2], [5, 6, 7]]
    f = tmp_path / "p.jsonl"
    row = {"prompt_input_ids": [1, 2, 3, 4], "chosen_input_ids": [5], "rejected_input_ids": [6]}
    f.write_text(json.dumps(row) + "\n" + json.dumps({**row, "chosen_input_ids": []}) + "\n")
    with pytest.raises(MespError, match=r"p.jsonl:2: an empty chosen"):
        load_pairs(f, None, 8, vocab=300)
    f.write_text(json.dumps(row) + "\n")
    (pair,) = load_pairs(f, None, 2, vocab=300)
    assert pair.chosen.ids == [3, 4, 5] and pair.chosen.mask == [0, 0, 1]
    with pytest.raises(MespError, match=r"p.jsonl:1: a sequence is longer"):
        load_pairs(f, None, 2, overlong="error", vocab=300)


@pytest.mark.slow  # 25 s: 25 steps and 3 validations (the resume test trains in the fast suite)
def test_train_dpo_raises_preference_accuracy(model_dir: Path, tmp_path: Path) -> None:
    data, out = write_pairs(tmp_path / "pairs.jsonl"), tmp_path / "ad"
    argv = train_argv(
        model_dir, data, out, *["--objective", "dpo", "--quantize", "none"],
        steps=25, batch_size=4, lr="1e-2", rank=4, eval_every=10, warmup=0, seq_len=48,
        beta=0.5, valid_fraction=0.2,
    )  # fmt: skip
    assert main(argv) == 0
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    valid = [r for r in log if "valid_accuracy" in r]
    assert len(valid) == 3 and all("valid_margin" in r for r in valid)
    s = json.loads((out / "summary.json").read_text())
    assert s["valid_accuracy_before"] == 0.0  # the policy starts as the reference: margin 0
    assert s["valid_accuracy_after"] >= 0.75 and valid[-1]["valid_margin"] > 0
    state = (out / "run_args.json").read_text()
    assert json.loads(state)["objective"] == "dpo"
    fp = load_state(out).fingerprint  # a resume as ORPO, or another β, is refused
    assert fp["objective"] == {
        "kind": "dpo",
        "beta": 0.5,
        "orpo_lambda": 0.1,
        "loss_type": "sigmoid",
    }


@pytest.mark.parametrize("objective", ["dpo", "orpo", "dpo --loss-type ipo"])
def test_grad_objective(objective: str, model_dir: Path, tmp_path: Path) -> None:
    data = write_pairs(tmp_path / "pairs.jsonl", 4)
    outs = []
    for engine in ("bp", "mesp"):
        o = tmp_path / f"{engine}.safetensors"
        argv = ["grad", "--model", str(model_dir), "--data", str(data), "--engine", engine]
        argv += ["--objective", *objective.split(), "--batch-size", "2", "--init-b", "0.01"]
        assert main([*argv, "--quantize", "none", "--seq-len", "64", "--out", str(o)]) == 0
        outs.append(o)
    with safe_open(str(outs[0]), "pt") as a, safe_open(str(outs[1]), "pt") as b:
        assert a.metadata()["loss"][:6] == b.metadata()["loss"][:6]
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert (x - y).abs().max() <= 1e-4 * x.abs().max(), k


def test_refusals(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_pairs(tmp_path / "pairs.jsonl", 4)
    argv = train_argv(model_dir, data, tmp_path / "o", "--objective", "dpo", engine="mezo")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "needs --engine bp, mebp or mesp, not mezo" in err and "\n" not in err
    hinge = ["--objective", "dpo", "--loss-type", "hinge", "--label-smoothing", "0.1"]
    assert main(train_argv(model_dir, data, tmp_path / "o", *hinge)) == 2
    err = capsys.readouterr().err.strip()
    assert "--label-smoothing applies to --loss-type sigmoid" in err and "\n" not in err
    assert not (tmp_path / "o").exists()
    sft = train_argv(model_dir, data, tmp_path / "o", "--objective", "orpo", seq_len=64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + '{"prompt": "a", "chosen": 3, "rejected": "b"}\n')
    sft[sft.index(str(data))] = str(bad)
    assert main(sft) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mesp: error: {bad}:5: ") and err.count("\n") == 1


def test_dpo_resume_is_bit_identical_and_keeps_the_objective(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 steps + --resume to 4 gives the adapter of 4 steps straight (the pair stream's
    position and the objective are in the state); resuming as ORPO is refused."""
    data = write_pairs(tmp_path / "pairs.jsonl", 16)
    flags = dict(batch_size=2, lr="1e-2", rank=2, eval_every=0, warmup=0, seq_len=48, save_every=1)
    flags |= dict(valid_fraction=0.25, eval_batches=1, schedule="constant")  # steps change
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(train_argv(model_dir, data, whole, "--objective", "dpo", steps=4, **flags)) == 0
    assert main(train_argv(model_dir, data, part, "--objective", "dpo", steps=2, **flags)) == 0
    resume = ["train", "--resume", str(part), "--steps", "4", "--no-progress"]
    assert main(resume) == 0
    a = (whole / "adapter_model.safetensors").read_bytes()
    assert a == (part / "adapter_model.safetensors").read_bytes()
    capsys.readouterr()
    for other in (["--objective", "orpo"], ["--label-smoothing", "0.1"]):
        assert main([*resume, *other]) == 2
        err = capsys.readouterr().err
        assert "cannot resume" in err and "objective" in err


def test_dpo_run_logs_to_tensorboard_and_writes_a_peft_adapter(
    model_dir: Path, tmp_path: Path
) -> None:
    """The preference metrics reach TensorBoard under valid/ with log.jsonl's numbers, and the
    adapter is a plain PEFT adapter: PEFT loads it onto the HF model and gives mesp's logits."""
    import torch
    from peft import PeftModel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    from mesp.loading.session import ModelOptions, open_with_adapter

    data, out, tb = write_pairs(tmp_path / "pairs.jsonl", 12), tmp_path / "ad", tmp_path / "tb"
    flags = dict(batch_size=2, lr="1e-2", rank=2, eval_every=2, warmup=0, seq_len=48, steps=2)
    argv = train_argv(model_dir, data, out, "--objective", "dpo", "--quantize", "none", **flags)
    assert main([*argv, "--valid-fraction", "0.25", "--tensorboard", str(tb)]) == 0
    acc = EventAccumulator(str(tb))
    acc.Reload()
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    (valid,) = [r for r in rows if "valid_accuracy" in r]
    for key in ("accuracy", "margin", "loss"):
        (event,) = acc.Scalars(f"valid/{key}")
        assert event.step == 2 and event.value == pytest.approx(valid[f"valid_{key}"], rel=1e-6)

    ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7, 12]])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, str(out)).eval()
    ours = open_with_adapter(ModelOptions(model=str(model_dir), quantize="none"), str(out)).model
    with torch.no_grad():
        want, got = peft(ids).logits, ours(ids)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), peft.disable_adapter():
        base = peft(ids).logits
    assert not torch.allclose(base, want, atol=1e-6)  # the adapter was trained: it moves them
