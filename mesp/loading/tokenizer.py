"""Tokenizer: a `tokenizers.Tokenizer` plus the special ids and chat template a model ships with.

Built from an HF directory (tokenizer.json + tokenizer_config.json) or from GGUF metadata
(see `mesp.loading.gguf_tokenizer`). The chat template is rendered with jinja2, as HF does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from mesp.errors import MespError


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False  # whether the model expects BOS at the start of every sequence
    chat_template: str | None = None
    extra_eos_ids: list[int] = field(default_factory=list)  # e.g. <end_of_turn>, <|im_end|>

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS is prepended when the model wants it (or when asked)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` with each token's (start, end) character offsets in `text`, from one
        pass of the tokenizer; a BOS put in front has the empty span (0, 0)."""
        enc = self.backend.encode(text, add_special_tokens=False)
        ids, offsets = list(enc.ids), list(enc.offsets)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids, offsets = [self.bos_id, *ids], [(0, 0), *offsets]
        return ids, offsets

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    @property
    def stop_ids(self) -> set[int]:
        return {i for i in [self.eos_id, *self.extra_eos_ids] if i is not None}

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False
    ) -> str:
        """Render messages with the model's template; a plain 'role: content' form otherwise."""
        if not self.chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg: str) -> None:
            raise MespError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        bos = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.backend.id_to_token(self.eos_id) if self.eos_id is not None else ""
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos,
                eos_token=eos,
            )
        except jinja2.TemplateError as e:
            raise MespError(f"chat template failed to render: {e}") from None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json for specials and the chat template)."""
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise MespError(f"{tj}: missing tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises its own Exception type
            raise MespError(f"{tj}: cannot read tokenizer: {e}") from None
        cfg: dict[str, Any] = {}
        tc = path / "tokenizer_config.json"
        if tc.exists():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise MespError(f"{tc}: not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise MespError(f"{tc}: expected a JSON object")

        def tok_id(key: str) -> int | None:
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return backend.token_to_id(v) if isinstance(v, str) else None

        template = cfg.get("chat_template")
        if isinstance(template, list):  # HF allows a list of named templates
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        ct = path / "chat_template.jinja"
        if template is None and ct.exists():
            template = ct.read_text()
        bos_id = tok_id("bos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # Llama 3 adds BOS in tokenizer.json's post-processor, with no add_bos_token key
            # in tokenizer_config.json: ask the post-processor what it prepends.
            plain = backend.encode("a", add_special_tokens=False).ids
            full = backend.encode("a", add_special_tokens=True).ids
            if len(full) == len(plain) + 1 and full[1:] == plain:  # exactly one token in front
                if bos_id is None or full[0] == bos_id:
                    bos_id, add_bos = full[0], True
        return cls(
            backend=backend,
            bos_id=bos_id,
            eos_id=tok_id("eos_token"),
            pad_id=tok_id("pad_token"),
            add_bos=bool(add_bos),
            chat_template=template,
        )
