"""One decoded jsonl row -> `Example`, its format chosen by its keys (see `mesp.data`)."""

from __future__ import annotations

from typing import Any

from mesp.batch import Example
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer

FORMATS = (
    'accepted rows: {"text"}, {"prompt", "completion"}, {"messages"}, '
    '{"input_ids"} (+ optional "loss_mask")'
)


def row_bos(tok: Tokenizer) -> int | None:
    """The BOS id packed rows must start with, for models whose tokenizer adds BOS."""
    return tok.bos_id if tok.add_bos else None


def pad_id_of(tokenizer: Tokenizer) -> int:
    """The id used for padding: pad, else EOS, else 0 (padding is masked out anyway)."""
    for i in (tokenizer.pad_id, tokenizer.eos_id):
        if i is not None:
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


def _chat(row: dict[str, Any], tok: Tokenizer, mask_prompt: bool, where: str) -> Example:
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise MespError(f'{where}: "messages" must be a non-empty array of {{role, content}}')
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise MespError(f'{where}: messages[{j}] must be an object with "role", "content"')
        _string(m, "role", f"{where}: messages[{j}]")
        _string(m, "content", f"{where}: messages[{j}]")

    def render(ms: list[dict[str, Any]], gen: bool) -> list[int]:
        try:
            text = tok.apply_chat_template(ms, add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 -- template code comes with the model
            raise MespError(f"{where}: chat template failed on this row: {one_line(e)}") from None
        return tok.encode(text)

    ids = render(msgs, False)
    if not tok.chat_template and tok.eos_id is not None:
        ids.append(tok.eos_id)  # the plain fallback has no end-of-turn marker to learn
    if not mask_prompt:
        return all_trained(ids)
    if msgs[-1]["role"] != "assistant":
        raise MespError(f"{where}: with --mask-prompt the last message must be the assistant's")
    prompt = render(msgs[:-1], True)
    k = 0  # prompt length = common prefix, robust to BPE merging across the boundary
    while k < min(len(prompt), len(ids)) and prompt[k] == ids[k]:
        k += 1
    return Example(ids, [0] * k + [1] * (len(ids) - k))


def _pretokenized(row: dict[str, Any], tok: Tokenizer, where: str) -> Example:
    ids = row["input_ids"]
    if not isinstance(ids, list) or not all(type(x) is int for x in ids):
        raise MespError(f'{where}: "input_ids" must be an array of integers')
    if not ids:
        raise MespError(f'{where}: "input_ids" is empty')
    vocab = tok.vocab_size
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


def parse_row(row: Any, tok: Tokenizer, mask_prompt: bool = False, where: str = "row") -> Example:
    """One decoded jsonl row -> Example; format chosen by keys, in mlx-lm's precedence."""
    if not isinstance(row, dict):
        raise MespError(f"{where}: row is a JSON {_json_type(row)}, not an object; {FORMATS}")
    eos = [tok.eos_id] if tok.eos_id is not None else []
    if "messages" in row:
        return _chat(row, tok, mask_prompt, where)
    if "prompt" in row and "completion" in row:
        prompt, completion = _string(row, "prompt", where), _string(row, "completion", where)
        if tok.chat_template:  # as mlx-lm: a user turn and an assistant turn, templated
            msgs = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            return _chat({"messages": msgs}, tok, mask_prompt, where)
        p = tok.encode(prompt)
        c = tok.encode(completion, add_bos=False) + eos
        if mask_prompt:
            return Example(p + c, [0] * len(p) + [1] * len(c))
        return all_trained(p + c)
    if "text" in row:
        return all_trained(tok.encode(_string(row, "text", where)) + eos)
    if "input_ids" in row:
        return _pretokenized(row, tok, where)
    if "prompt" in row or "completion" in row:
        raise MespError(f'{where}: a row needs both "prompt" and "completion"; {FORMATS}')
    keys = ", ".join(repr(k[:40]) for k in list(row)[:6]) or "none"
    raise MespError(f"{where}: row has no known key (keys: {keys}); {FORMATS}")
