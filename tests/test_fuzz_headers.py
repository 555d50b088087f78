"""Property tests: arbitrary or mutated bytes given as a GGUF or safetensors file produce a
valid result or one MespError, never another exception or a hang.

Every example runs under a time bound (`time_bound`): SIGALRM interrupts Python code that loops,
and faulthandler ends the whole run, with every thread's stack, if C code never returns. Mutation
tests start from a valid tiny GGUF (written with the gguf package) or safetensors model and
flip, overwrite, insert or delete bytes in its header, where every length and count lives."""

from __future__ import annotations

import faulthandler
import functools
import json
import shutil
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesp.errors import MespError
from mesp.loading import load_model
from mesp.loading.gguf import read_gguf

SECONDS = 10.0  # per example; the slowest valid one takes well under a second
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
GGUF_HEAD = b"GGUF" + struct.pack("<I", 3)


class _Hang(BaseException):
    """Raised by the alarm; a BaseException so that no `except Exception` in the code under test
    turns a hang into a clean-looking error."""


@contextmanager
def time_bound(seconds: float = SECONDS) -> Iterator[None]:
    def alarm(signum: int, frame: object) -> None:
        raise _Hang

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds * 3, exit=True)  # stuck in C: no alarm gets in
    try:
        yield
    except _Hang:
        raise AssertionError(f"no result after {seconds:.0f} s: a hang") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


def _accepts(fn: Callable[..., Any], *args: Any) -> Any:
    """fn's result, or None after a one-line MespError; anything else fails the example."""
    with time_bound():
        try:
            return fn(*args)
        except MespError as e:
            assert "\n" not in str(e)
            return None


def test_the_time_bound_catches_a_hang() -> None:
    def spin() -> None:
        while True:
            pass

    with pytest.raises(AssertionError, match="hang"):
        with time_bound(0.2):
            spin()


# ---------------------------------------------------------------- arbitrary bytes


@SETTINGS
@given(st.binary(max_size=512), st.booleans())
def test_gguf_bytes(body: bytes, with_magic: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "x.gguf"
        f.write_bytes((GGUF_HEAD if with_magic else b"") + body)
        _accepts(read_gguf, f)


TINY_CONFIG = {
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


@SETTINGS
@given(st.integers(0, 2**64 - 1), st.binary(max_size=300))
def test_safetensors_bytes(header_len: int, body: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        (p / "config.json").write_text(json.dumps({"model_type": "llama", **TINY_CONFIG}))
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
        (p / "config.json").write_text(json.dumps({"model_type": "qwen2", **TINY_CONFIG}))
        (p / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
        _accepts(load_model, p)


# ---------------------------------------------------------------- mutations of valid files

# lengths, counts, type codes and offsets a parser must not trust
EDGE_INTS = [0, 1, 2, 7, 8, 9, 13, 31, 32, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32]
EDGE_INTS += [2**62, 2**63 - 1, 2**63, 2**64 - 1]


def _mutations(size: int) -> st.SearchStrategy[list[tuple]]:
    pos = st.integers(0, size - 1)
    return st.lists(
        st.one_of(
            st.tuples(st.just("set"), pos, st.integers(0, 255)),
            st.tuples(st.just("flip"), pos, st.integers(0, 7)),
            st.tuples(st.just("int"), pos, st.sampled_from(EDGE_INTS), st.sampled_from([4, 8])),
            st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=16)),
            st.tuples(st.just("delete"), pos, st.integers(1, 32)),
        ),
        min_size=1,
        max_size=4,
    )


def _mutate(data: bytes, ops: list[tuple]) -> bytes:
    b = bytearray(data)
    for op, at, *arg in ops:
        at = min(at, len(b) - 1)
        if op == "set":
            b[at] = arg[0]
        elif op == "flip":
            b[at] ^= 1 << arg[0]
        elif op == "int":
            value, width = arg
            b[at : at + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
        elif op == "insert":
            b[at:at] = arg[0]
        else:
            del b[at : at + arg[0]]
    return bytes(b)


@functools.cache
def _gguf_file(arch: str) -> tuple[bytes, int]:
    """A valid tiny GGUF of `arch` and its header's length (metadata + tensor infos)."""
    import gguf

    from tests.test_gguf import write_model

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.gguf"
        write_model(f, arch, n_layers=1)
        return f.read_bytes(), int(gguf.GGUFReader(f).data_offset)


GGUF_ARCHS = ["llama", "qwen2"]  # an SPM and a byte-level BPE tokenizer in the metadata


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_the_unmutated_gguf_loads(arch: str, tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(_gguf_file(arch)[0])
    assert load_model(f).model is not None


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_mutated_gguf_header(data: st.DataObject) -> None:
    arch = data.draw(st.sampled_from(GGUF_ARCHS), label="arch")
    raw, header_end = _gguf_file(arch)
    ops = data.draw(_mutations(header_end), label="ops")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.gguf"
        f.write_bytes(_mutate(raw, ops))
        _accepts(load_model, f)


def test_zero_head_count_is_one_line() -> None:
    """Found by the fuzzer above in CI: a header whose attention.head_count byte was zeroed
    divided by it (hidden // heads) and ended in a ZeroDivisionError traceback."""
    raw, _ = _gguf_file("llama")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.gguf"
        f.write_bytes(_mutate(raw, [("set", 255, 0)]))
        with pytest.raises(MespError, match="head_count' must be positive, got 0"):
            load_model(f)


LLAMA_CONFIG = {
    "model_type": "llama",
    **TINY_CONFIG,
    "intermediate_size": 16,
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def st_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid tiny HF llama directory: config.json + model.safetensors, nothing else."""
    import torch
    from safetensors.torch import save_file

    v, h, i, kv = 8, 8, 16, 4  # kv = 1 head of head_dim 4
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for leaf, shape in {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }.items():
        shapes[f"model.layers.0.{leaf}"] = shape
    g = torch.Generator().manual_seed(0)
    d = tmp_path_factory.mktemp("fuzz")
    save_file(
        {k: torch.randn(s, generator=g) for k, s in shapes.items()},
        str(d / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (d / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    return d


def _load_mutated_dir(model: Path, weights: bytes) -> Any:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        shutil.copy(model / "config.json", p / "config.json")
        (p / "model.safetensors").write_bytes(weights)
        return _accepts(load_model, p)


def test_the_unmutated_safetensors_loads(st_model: Path) -> None:
    assert _load_mutated_dir(st_model, (st_model / "model.safetensors").read_bytes()) is not None


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_mutated_safetensors_header(st_model: Path, data: st.DataObject) -> None:
    raw = (st_model / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    ops = data.draw(_mutations(header_end), label="ops")
    _load_mutated_dir(st_model, _mutate(raw, ops))


FIELD_VALUES = st.one_of(
    st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "BOOL", "F64", "X", ""]),
    st.sampled_from(EDGE_INTS + [-1, -(2**63)]),
    st.lists(st.sampled_from(EDGE_INTS + [-1, 3, 5]), max_size=4),
    st.none(),
    st.text(max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_edited_safetensors_header_json(st_model: Path, data: st.DataObject) -> None:
    """Valid JSON, wrong content: a dtype, shape, offset, or whole entry replaced, dropped or
    added, with the header length kept consistent."""
    raw = (st_model / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        name = data.draw(st.sampled_from(names), label="tensor")
        what = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "drop", "entry"]))
        if what == "drop":
            header.pop(name, None)
        elif what == "entry":
            header[name] = data.draw(FIELD_VALUES, label="entry")
        elif isinstance(header.get(name), dict):
            header[name][what] = data.draw(FIELD_VALUES, label=what)
    new = json.dumps(header).encode()
    _load_mutated_dir(st_model, struct.pack("<Q", len(new)) + new + body)


# ---------------------------------------------------------------- deep nesting

DEPTH = 5000  # past Python's recursion limit, a few tens of KiB of header


def test_deeply_nested_gguf_array(tmp_path: Path) -> None:
    kv = struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9)  # key "a", type ARRAY
    kv += struct.pack("<IQ", 9, 1) * DEPTH + struct.pack("<IQ", 4, 0)  # array of array of ...
    f = tmp_path / "deep.gguf"
    f.write_bytes(GGUF_HEAD + struct.pack("<QQ", 0, 1) + kv)
    _accepts(read_gguf, f)


def test_deeply_nested_safetensors_header(tmp_path: Path) -> None:
    raw = ('{"a": ' + "[" * DEPTH + "]" * DEPTH + "}").encode()
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    _accepts(load_model, tmp_path)
