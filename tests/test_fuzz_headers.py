"""Property tests: arbitrary or mutated bytes given as a GGUF or safetensors file produce a
valid result or one MespError, never another exception or a hang."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesp.errors import MespError
from mesp.loading import load_model
from mesp.loading.gguf import read_gguf

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
GGUF_HEAD = b"GGUF" + struct.pack("<I", 3)


def _accepts(fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except MespError as e:
        assert "\n" not in str(e)


@SETTINGS
@given(st.binary(max_size=512), st.booleans())
def test_gguf_bytes(body: bytes, with_magic: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "x.gguf"
        f.write_bytes((GGUF_HEAD if with_magic else b"") + body)
        _accepts(read_gguf, f)


@SETTINGS
@given(st.integers(0, 2**64 - 1), st.binary(max_size=300))
def test_safetensors_bytes(header_len: int, body: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        (p / "config.json").write_text(
            json.dumps(
                {
                    "model_type": "llama",
                    "vocab_size": 8,
                    "hidden_size": 8,
                    "intermediate_size": 8,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                }
            )
        )
        (p / "model.safetensors").write_bytes(struct.pack("<Q", header_len) + body)
        _accepts(load_model, p)


@SETTINGS
@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.none(),
            st.integers(),
            st.text(max_size=5),
            st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(["F32", "U8", "X"]),
                    "shape": st.lists(st.integers(-2, 5), max_size=3),
                    "data_offsets": st.lists(st.integers(-5, 99), max_size=3),
                }
            ),
        ),
        max_size=4,
    )
)
def test_safetensors_headers(header: dict) -> None:
    raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        (p / "config.json").write_text(
            json.dumps(
                {
                    "model_type": "qwen2",
                    "vocab_size": 8,
                    "hidden_size": 8,
                    "intermediate_size": 8,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                }
            )
        )
        (p / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
        _accepts(load_model, p)
