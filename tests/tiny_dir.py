"""A tiny on-disk model directory (HF safetensors + a real BPE tokenizer) for CLI tests."""

from __future__ import annotations

import json
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
