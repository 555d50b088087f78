"""`--model org/name` and `--adapter org/name` from a Hugging Face cache laid out on disk as
huggingface_hub lays it out (refs/, snapshots/<commit>/ of links into blobs/), with no
network: info, train and eval run on it; revisions; a local path wins; not cached and offline
(or without huggingface_hub) is one line and exit 2; a download goes through
snapshot_download with the cache, revision and only the files mesp reads."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

from mesp.cli import main
from mesp.loading.hub import cache_dir, local_path, parse
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FAST = ["--quantize", "none", "--seq-len", "48", "--batch-size", "2"]


def lay_out(cache: Path, repo: str, src: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """`src`'s files as the snapshot `commit` of `repo`, `refs/<ref>` pointing at it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    return {"model": make_model_dir(root / "m", "qwen2"), "data": make_jsonl(root / "d.jsonl", 16)}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache in HF_HUB_CACHE, offline, run from a directory without an `org/`."""
    c = tmp_path / "hf-cache"
    c.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(c))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return c


def _eval(capsys: pytest.CaptureFixture, model: str, data: Path, *extra: str) -> float:
    argv = ["eval", "--model", model, "--data", str(data), *FAST, "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["loss"]


def test_info_train_eval_and_adapter_from_the_cache(
    src: dict[str, Path], cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    snap = lay_out(cache, "org/tiny", src["model"])
    assert (snap / "config.json").is_symlink()
    assert main(["info", "--model", "org/tiny"]) == 0
    assert "qwen2" in capsys.readouterr().out
    out = tmp_path / "ad"
    argv = train_argv("org/tiny", src["data"], out, *FAST, steps=2, eval_batches=1)  # type: ignore[arg-type]
    assert main([*argv, "--no-progress"]) == 0
    assert str(snap) in capsys.readouterr().out  # the snapshot was trained on
    # the base from the cache scores as the same model from its own directory
    base = _eval(capsys, "org/tiny", src["data"])
    assert base == _eval(capsys, str(src["model"]), src["data"])
    # the adapter, put in the cache as org/tiny-lora, loads by its id and scores as itself
    lay_out(cache, "org/tiny-lora", out, ref="main")
    tuned = _eval(capsys, "org/tiny", src["data"], "--adapter", str(out))
    assert tuned != base
    assert _eval(capsys, "org/tiny", src["data"], "--adapter", "org/tiny-lora") == tuned


def test_revisions_and_what_is_not_a_hub_id(src: dict[str, Path], cache: Path) -> None:
    main_snap = lay_out(cache, "org/tiny", src["model"])
    other = "f" * 40
    v2 = lay_out(cache, "org/tiny", src["model"], commit=other, ref="v2")
    assert local_path("org/tiny") == main_snap
    assert local_path("org/tiny@main") == main_snap
    assert local_path("org/tiny@v2") == v2 == local_path(f"org/tiny@{other}")
    assert parse("org/tiny@v2") == ("org/tiny", "v2", None)
    assert parse("org/tiny-GGUF@v2/q/m.Q4_0.gguf") == ("org/tiny-GGUF", "v2", "q/m.Q4_0.gguf")
    for not_an_id in ("smollm2", "random:qwen2.5-0.5b", "./org/tiny", "/org/tiny", "a/b/c",
                      "org/..", "org/tiny@../x", "model.gguf", "org/x/../y.gguf"):  # fmt: skip
        assert parse(not_an_id) is None and local_path(not_an_id) is None, not_an_id
    # a local path that exists wins over the Hub id it spells
    shutil.copytree(src["model"], Path("org") / "tiny")
    assert local_path("org/tiny") is None


def test_not_cached_and_offline_is_one_line(
    src: dict[str, Path], cache: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    def refused(*argv: str) -> str:
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert err.startswith("mesp: error: ") and err.count("\n") == 1, err
        return err

    err = refused("info", "--model", "org/missing")
    assert f"org/missing: not in the Hugging Face cache ({cache})" in err
    assert "HF_HUB_OFFLINE is set" in err and "hf download org/missing" in err
    err = refused("eval", "--model", str(src["model"]), "--data", str(src["data"]),
                  "--adapter", "org/no-lora", *FAST)  # fmt: skip
    assert "org/no-lora: not in the Hugging Face cache" in err
    # a snapshot whose blob was evicted is not in the cache either
    snap = lay_out(cache, "org/evicted", src["model"])
    os.unlink((snap / "model.safetensors").resolve())
    assert "org/evicted: not in" in refused("info", "--model", "org/evicted")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails: not installed
    err = refused("info", "--model", "org/missing")
    assert "huggingface_hub is not installed" in err and "pip install huggingface_hub" in err


def test_a_missing_repository_is_downloaded_through_huggingface_hub(
    src: dict[str, Path], cache: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:  # fmt: skip
    """The library's side stands in for the network: it lays `src` out in the cache as the
    Hub would, fetching only the files the patterns ask for."""
    (src_model := cache.parent / "repo").mkdir()
    for f in src["model"].iterdir():
        shutil.copy(f, src_model / f.name)
    (src_model / "pytorch_model.bin").write_bytes(b"not fetched")
    calls: list[dict] = []

    def snapshot_download(repo_id: str, **kw: object) -> str:
        calls.append({"repo_id": repo_id, **kw})
        picked = cache.parent / "picked"
        for f in src_model.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in kw["allow_patterns"]):  # type: ignore[attr-defined]
                (picked / f.name).parent.mkdir(exist_ok=True)
                shutil.copy(f, picked / f.name)
        return str(lay_out(Path(str(kw["cache_dir"])), repo_id, picked, ref=str(kw["revision"])))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    assert main(["info", "--model", "org/remote@v1"]) == 0
    assert "downloading" in capsys.readouterr().err
    assert calls[0]["repo_id"] == "org/remote" and calls[0]["revision"] == "v1"
    assert calls[0]["cache_dir"] == str(cache)
    snap = local_path("org/remote@v1")  # now cached: no second download
    assert snap is not None and len(calls) == 1
    assert (snap / "model.safetensors").is_file() and not (snap / "pytorch_model.bin").exists()


def test_cache_dir_follows_huggingface_hubs_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"


def test_a_gguf_file_of_a_repository(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """org/name/FILE.gguf names one quantization of a GGUF repository; org/name alone does
    where the snapshot holds one .gguf, and says which there are where it holds several."""
    from tests.test_gguf import write_model

    repo = tmp_path / "repo"
    repo.mkdir()
    write_model(repo / "tiny.Q8_0.gguf", "qwen2")
    (repo / "README.md").write_text("a model card\n")
    lay_out(cache, "org/one-GGUF", repo)
    for ref in ("org/one-GGUF/tiny.Q8_0.gguf", "org/one-GGUF"):
        assert main(["info", "--model", ref]) == 0
        assert "qwen2" in capsys.readouterr().out
    write_model(repo / "tiny.F16.gguf", "qwen2")
    lay_out(cache, "org/two-GGUF", repo)
    assert main(["info", "--model", "org/two-GGUF"]) == 2
    err = capsys.readouterr().err
    assert "2 .gguf files (tiny.F16.gguf, tiny.Q8_0.gguf)" in err and err.count("\n") == 1
    assert main(["info", "--model", "org/two-GGUF/tiny.F16.gguf"]) == 0
    assert main(["info", "--model", "org/two-GGUF/tiny.Q4_0.gguf"]) == 2  # not in the snapshot
    assert "hf download org/two-GGUF tiny.Q4_0.gguf" in capsys.readouterr().err
