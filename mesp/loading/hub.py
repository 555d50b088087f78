"""Hugging Face Hub ids: `--model org/name` and `--adapter org/name` from the local HF cache.

The cache is what `huggingface_hub` writes: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub` (`$XDG_CACHE_HOME` for `~/.cache` where set). A repository lives in
`models--org--name/`: `refs/<branch>` holds a commit hash, `snapshots/<hash>/` the files (links
into `blobs/`). Reading it needs no network and no `huggingface_hub`.

`org/name@REV` picks a branch or tag (`refs/REV`) or a commit hash; the default is `main`. A
repository missing from the cache is downloaded with `huggingface_hub.snapshot_download` where
that package is installed and `HF_HUB_OFFLINE` is not set (only the files mesp reads); else
the error says how to get it. A local path that exists always wins over a Hub id.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from mesp.errors import MespError

# org/name as the Hub spells repository ids; a revision after '@' (branch, tag or commit)
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_REV = re.compile(r"[\w.-]+(/[\w.-]+)*")
_TRUE = {"1", "true", "yes", "on"}

# what each kind of directory must hold, and what a download fetches (no .bin, .onnx, .h5...)
_NEEDS = {"model": ("config.json",), "adapter": ("adapter_config.json",)}
_FETCH = {
    "model": ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
    "adapter": ["adapter_config.json", "adapter_model.safetensors"],
}


def cache_dir() -> Path:
    """Where huggingface_hub keeps repositories, by its own environment variables."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second: its older name
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def parse(ref: str) -> tuple[str, str | None] | None:
    """`org/name[@rev]` -> (repo id, revision); None for anything else (a path, a wheel name)."""
    repo, _, rev = ref.partition("@")
    if not _ID.fullmatch(repo) or ".." in ref or (rev and not _REV.fullmatch(rev)):
        return None
    return repo, rev or None


def snapshot(cache: Path, repo: str, revision: str | None = None) -> Path | None:
    """The cached snapshot of `repo` at `revision` (a ref name or a commit hash), if any."""
    root = cache / f"models--{repo.replace('/', '--')}"
    ref = root / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else (revision or "")
    d = root / "snapshots" / commit
    return d if commit and d.is_dir() else None


def _complete(d: Path, kind: str) -> bool:
    """Holds what `kind` needs, every link resolving (a broken link: an evicted blob)."""
    if not all((d / f).is_file() for f in _NEEDS[kind]):
        return False
    return any(f.is_file() for f in d.glob("*.safetensors"))


def local_path(ref: str, kind: str = "model") -> Path | None:
    """The directory a Hub id names (`kind`: "model" or "adapter"), from the cache or just
    downloaded; None when `ref` is an existing path or no Hub id. Raises MespError (one line)
    when it is neither cached nor downloadable."""
    parsed = None if Path(ref).expanduser().exists() else parse(ref)
    if parsed is None:
        return None
    repo, rev = parsed
    cache = cache_dir()
    d = snapshot(cache, repo, rev)
    if d is not None and _complete(d, kind):
        return d
    return _download(ref, repo, rev, cache, kind)


def adapter_dir(ref: str) -> Path:
    """`--adapter`: a PEFT adapter directory, or a Hub id of one."""
    return local_path(ref, "adapter") or Path(ref)


def _download(ref: str, repo: str, rev: str | None, cache: Path, kind: str) -> Path:
    why = ""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        why, how = "HF_HUB_OFFLINE is set", f"`hf download {repo}` where online"
    else:
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            why = "huggingface_hub is not installed"
            how = f"`pip install huggingface_hub && hf download {repo}`"
    if why:
        raise MespError(
            f"{ref}: not in the Hugging Face cache ({cache}) and {why}; download it with "
            f"{how}, or pass a local path"
        )
    print(f"mesp: {ref}: not in {cache}; downloading it from the Hugging Face Hub", file=sys.stderr)
    try:
        got = snapshot_download(
            repo, revision=rev, cache_dir=str(cache), allow_patterns=_FETCH[kind]
        )
    except Exception as e:  # no such repository, gated, no network: the library's own words
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MespError(f"{ref}: could not download from the Hugging Face Hub ({line})") from None
    d = Path(got)
    if not _complete(d, kind):
        needs = ", ".join(_NEEDS[kind])
        raise MespError(
            f"{ref}: the Hub repository has no {kind} mesp reads ({needs} + .safetensors)"
        )
    return d
