"""A tiny on-disk model directory (HF safetensors + a real BPE tokenizer) for CLI tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.hf_tiny import hf_model

TEXT = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep;",
] * 4
VOCAB = 300
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<eos>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def make_model_dir(path: Path, family: str = "llama", **over: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    hf = hf_model(family, vocab_size=VOCAB, **over)
    hf.save_pretrained(str(path))
    make_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "pad_token": "<eos>", "chat_template": TEMPLATE})
    )
    return path


def make_jsonl(path: Path, n: int = 40) -> Path:
    rows = [{"prompt": TEXT[i % 5], "completion": " " + TEXT[(i + 1) % 5]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_argv(
    model: Path, data: Path, out: Path, *extra: str, python: bool = False, **flags: object
) -> list[str]:
    """`mesp train --model M --data D --FLAG V … --no-progress --adapter-out OUT EXTRA…`, with
    keyword flags by their dataclass names (seq_len=48 -> --seq-len 48); `python`: as the
    command `python -m mesp train …`, for tests that need a process of its own."""
    argv = ["train", "--model", str(model), "--data", str(data)]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    argv += ["--no-progress", "--adapter-out", str(out), *extra]
    return [sys.executable, "-m", "mesp", *argv] if python else argv
