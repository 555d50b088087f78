"""One decoded jsonl row -> `Example`, its format chosen by its keys (see `mesp.data`)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from typing import Any

from mesp.batch import Example
from mesp.config import ModelConfig
from mesp.data.config import TRAIN_ON
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer

FORMATS = (
    'accepted rows: {"text"}, {"prompt", "completion"}, {"messages"}, '
    '{"input_ids"} (+ optional "loss_mask")'
)


def row_bos(tok: Tokenizer | None) -> int | None:
    """The BOS id packed rows must start with, for models whose tokenizer adds BOS (without a
    tokenizer, pre-tokenized rows carry their own)."""
    return tok.bos_id if tok is not None and tok.add_bos else None


def pad_id_of(tokenizer: Tokenizer | None, config: ModelConfig | None = None) -> int:
    """The id used for padding: pad, else EOS, else 0 (padding is masked out anyway). Without
    a tokenizer, the model config's pad / EOS id."""
    if tokenizer is not None:
        ids = [tokenizer.pad_id, tokenizer.eos_id]
    elif config is not None:
        eos = config.eos_token_id
        ids = [config.pad_token_id, (eos[0] if eos else None) if isinstance(eos, list) else eos]
    else:
        ids = []
    for i in ids:
        if i is not None and (config is None or 0 <= i < config.vocab_size):
            return i
    return 0


def one_line(msg: object) -> str:
    return " ".join(str(msg).split())[:300]


def _json_type(v: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(v), "number")


def _string(row: dict[str, Any], key: str, where: str) -> str:
    v = row[key]
    if not isinstance(v, str):
        raise MespError(f'{where}: "{key}" must be a string, got {_json_type(v)}')
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise MespError(f'{where}: "{key}" contains an unpaired surrogate escape') from None
    return v


def all_trained(ids: list[int]) -> Example:
    return Example(ids, [0] + [1] * (len(ids) - 1) if ids else [])


def _chat(row: dict[str, Any], tok: Tokenizer, train_on: str, where: str) -> Example:
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise MespError(f'{where}: "messages" must be a non-empty array of {{role, content}}')
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise MespError(f'{where}: messages[{j}] must be an object with "role", "content"')
        _string(m, "role", f"{where}: messages[{j}]")
        _string(m, "content", f"{where}: messages[{j}]")

    def text(ms: list[dict[str, Any]], gen: bool) -> str:
        try:
            return tok.apply_chat_template(ms, add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 -- template code comes with the model
            raise MespError(f"{where}: chat template failed on this row: {one_line(e)}") from None

    # the plain fallback has no end-of-turn marker to learn: EOS stands in for it
    eos = [tok.eos_id] if not tok.chat_template and tok.eos_id is not None else []
    if train_on == "all-assistant":
        return _every_assistant(msgs, text, tok, eos, where)
    ids = tok.encode(text(msgs, False)) + eos
    if train_on == "all":
        return all_trained(ids)
    if msgs[-1]["role"] != "assistant":
        raise MespError(f"{where}: with --mask-prompt the last message must be the assistant's")
    prompt = tok.encode(text(msgs[:-1], True))
    k = 0  # prompt length = common prefix, robust to BPE merging across the boundary
    while k < min(len(prompt), len(ids)) and prompt[k] == ids[k]:
        k += 1
    return Example(ids, [0] * k + [1] * (len(ids) - k))


Render = Callable[[list[dict[str, Any]], bool], str]
_PLACEHOLDER = "mesp0reply0placeholder"  # plain letters: no template trims or splits them


def _after_reply(msgs: list[dict[str, Any]], i: int, text: Render) -> str:
    """What the template writes after assistant message i's text (e.g. "<|im_end|>\n")."""
    r = text([*msgs[:i], {**msgs[i], "content": _PLACEHOLDER}], False)
    k = r.rfind(_PLACEHOLDER)
    return r[k + len(_PLACEHOLDER) :] if k >= 0 else ""


def _every_assistant(
    msgs: list[dict[str, Any]], text: Render, tok: Tokenizer, eos: list[int], where: str
) -> Example:
    """Every assistant reply trained: its character span in the rendered conversation, mapped
    to tokens through the offsets of one encoding of the whole text (pieces tokenized apart
    can merge differently from the whole). A token holding any reply character is trained,
    so a token merged across a reply's edge is trained, as --mask-prompt's rule trains it."""
    full = text(msgs, False)
    spans = _assistant_spans(msgs, full, text, where)
    ids, offsets = tok.encode_offsets(full)
    ends = [b for _, b in spans]
    mask: list[int] = []
    for s, e in offsets:
        j = bisect_right(ends, s)  # the first span that ends after this token starts
        # a zero-width token (offsets trimmed to nothing) counts as the character it sits at
        mask.append(int(j < len(spans) and spans[j][0] < max(e, s + 1)))
    if eos:  # EOS ends the last reply when the conversation ends with one
        ids, mask = ids + eos, mask + [int(msgs[-1]["role"] == "assistant")]
    return Example(ids, [0] + mask[1:])


def _assistant_spans(
    msgs: list[dict[str, Any]], full: str, text: Render, where: str
) -> list[tuple[int, int]]:
    """(start, end) in `full` of each assistant reply: from the end of the generation prompt
    before it to the end of what the template writes for that message, so the end-of-turn
    marker (<|im_end|>, <end_of_turn>) and the newline after it are inside: the model learns
    to stop, and the final reply gets exactly the targets --mask-prompt gives it."""
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        pre, upto = text(msgs[:i], True), text(msgs[: i + 1], False)
        if not full.startswith(pre):
            raise MespError(
                f"{where}: the chat template renders the turns before messages[{i}] differently "
                "inside the whole conversation, so that reply cannot be located"
            )
        if full.startswith(upto) and len(upto) >= len(pre):
            spans.append((len(pre), len(upto)))
            continue
        # Qwen3-style templates give the final turn a <think> block that an earlier turn
        # loses once a user turn follows: that reply then ends at the first end-of-turn marker
        # after its start, the marker being what the template writes after a reply's text.
        marker = _after_reply(msgs, i, text)
        end = full.find(marker, len(pre)) if marker else -1
        if end < 0:
            raise MespError(
                f"{where}: messages[{i}]: the chat template renders this reply differently "
                "inside the whole conversation and ends it with no marker, so it cannot be located"
            )
        spans.append((len(pre), end + len(marker)))
    return spans


def _pretokenized(row: dict[str, Any], vocab: int, where: str) -> Example:
    ids = row["input_ids"]
    if not isinstance(ids, list) or not all(type(x) is int for x in ids):
        raise MespError(f'{where}: "input_ids" must be an array of integers')
    if not ids:
        raise MespError(f'{where}: "input_ids" is empty')
    bad = next((x for x in ids if not 0 <= x < vocab), None)
    if bad is not None:
        shown = str(bad) if bad.bit_length() < 64 else "beyond 64 bits"
        raise MespError(
            f"{where}: input_ids has token id {shown} outside the vocabulary (0..{vocab - 1})"
        )
    if "loss_mask" not in row:
        return all_trained(ids)
    lm = row["loss_mask"]
    if not isinstance(lm, list) or not all(type(x) in (int, bool) and x in (0, 1) for x in lm):
        raise MespError(f'{where}: "loss_mask" must be an array of 0/1')
    if len(lm) != len(ids):
        raise MespError(f'{where}: "loss_mask" has {len(lm)} entries, "input_ids" {len(ids)}')
    return Example(ids, [0] + [int(x) for x in lm[1:]])


NO_TOKENIZER = (
    "is text, which needs a tokenizer, and the model has none (tokenizer.json or GGUF "
    'metadata); without one only pre-tokenized {"input_ids"} rows can be used'
)


def parse_row(
    row: Any,
    tok: Tokenizer | None,
    mask_prompt: bool = False,
    where: str = "row",
    train_on: str = "all",
    vocab_size: int | None = None,
) -> Example:
    """One decoded jsonl row -> Example; format chosen by keys, in mlx-lm's precedence.
    `train_on` picks the targets (see `DataConfig.train_on`); `mask_prompt` means
    "last-assistant". Pre-tokenized ids must lie below `vocab_size` (the model's; default: the
    tokenizer's); they need no tokenizer, every other format does."""
    if not isinstance(row, dict):
        raise MespError(f"{where}: row is a JSON {_json_type(row)}, not an object; {FORMATS}")
    if train_on not in TRAIN_ON:
        raise MespError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    masked = "last-assistant" if mask_prompt else train_on
    if masked != "all" and "messages" not in row and not ("prompt" in row and "completion" in row):
        # no reply to pick out: the flag would silently train every token
        what = (
            'a {"text"} row'
            if "text" in row
            else 'an {"input_ids"} row without "loss_mask"'
            if "input_ids" in row and "loss_mask" not in row
            else None
        )
        if what is not None:
            raise no_replies(where, what, mask_prompt, train_on)
    if tok is None:
        if "messages" in row or "text" in row or ("prompt" in row and "completion" in row):
            raise MespError(f"{where}: this row {NO_TOKENIZER}")
        if "input_ids" in row:
            if vocab_size is None:
                raise ValueError("parse_row needs a tokenizer or the model's vocab_size")
            return _pretokenized(row, vocab_size, where)
        return _unknown(row, where)
    train_on = masked
    eos = [tok.eos_id] if tok.eos_id is not None else []
    if "messages" in row:
        return _chat(row, tok, train_on, where)
    if "prompt" in row and "completion" in row:
        completion_only = train_on != "all"  # one assistant turn: the last is the only one
        prompt, completion = _string(row, "prompt", where), _string(row, "completion", where)
        if tok.chat_template:  # as mlx-lm: a user turn and an assistant turn, templated
            msgs = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            mode = "last-assistant" if completion_only else "all"
            return _chat({"messages": msgs}, tok, mode, where)
        p = tok.encode(prompt)
        c = tok.encode(completion, add_bos=False) + eos
        if completion_only:
            return Example(p + c, [0] * len(p) + [1] * len(c))
        return all_trained(p + c)
    if "text" in row:
        return all_trained(tok.encode(_string(row, "text", where)) + eos)
    if "input_ids" in row:
        return _pretokenized(row, tok.vocab_size if vocab_size is None else vocab_size, where)
    return _unknown(row, where)


def no_replies(where: str, what: str, mask_prompt: bool, train_on: str) -> MespError:
    """--mask-prompt / --train-on *-assistant on data with no prompt or reply to tell apart."""
    flag = "--mask-prompt" if mask_prompt else f"--train-on {train_on}"
    return MespError(
        f"{where}: {flag} trains only replies (a completion, assistant messages) and {what} "
        'has none; use {"messages"} or {"prompt", "completion"} rows, or drop the flag to train '
        "every token"
    )


def _unknown(row: dict[str, Any], where: str) -> Example:
    if "prompt" in row or "completion" in row:
        raise MespError(f'{where}: a row needs both "prompt" and "completion"; {FORMATS}')
    keys = ", ".join(repr(k[:40]) for k in list(row)[:6]) or "none"
    raise MespError(f"{where}: row has no known key (keys: {keys}); {FORMATS}")
