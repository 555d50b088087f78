"""Hugging Face Hub ids: `--model org/name` and `--adapter org/name` from the local HF cache.

The cache is what `huggingface_hub` writes: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub` (`$XDG_CACHE_HOME` for `~/.cache` where set). A repository lives in
`models--org--name/`: `refs/<branch>` holds a commit hash, `snapshots/<hash>/` the files (links
into `blobs/`). Reading it needs no network and no `huggingface_hub`.

`org/name@REV` picks a branch or tag (`refs/REV`) or a commit hash; the default is `main`.
`org/name/FILE.gguf` (or `org/name` where the snapshot holds one .gguf) names a GGUF file of
a repository that holds several quantizations. A repository missing from the cache is
downloaded with `huggingface_hub.snapshot_download` where that package is installed and
`HF_HUB_OFFLINE` is not set (only the files mesp reads); else the error says how to get it. A
local path that exists always wins over a Hub id.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from mesp.errors import MespError

# org/name as the Hub spells repository ids, a revision after '@' (branch, tag or commit), a
# .gguf file in the repository after a '/'
_REF = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.-]+))?"
    r"(?:/(?P<file>[\w.-]+(?:/[\w.-]+)*\.gguf))?"
)
_TRUE = {"1", "true", "yes", "on"}

# what each kind of directory must hold, and what a download fetches (no .bin, .onnx, .h5...)
_NEEDS = {
    "model": ("config.json",),
    "adapter": ("adapter_config.json", "adapter_model.safetensors"),
}
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


def parse(ref: str) -> tuple[str, str | None, str | None] | None:
    """`org/name[@rev][/FILE.gguf]` -> (repo id, revision, file); None for anything else (a
    path, a wheel name)."""
    m = _REF.fullmatch(ref)
    if m is None or ".." in ref:
        return None
    return m["repo"], m["rev"], m["file"]


def snapshot(cache: Path, repo: str, revision: str | None = None) -> Path | None:
    """The cached snapshot of `repo` at `revision` (a ref name or a commit hash), if any."""
    root = cache / f"models--{repo.replace('/', '--')}"
    ref = root / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else (revision or "")
    d = root / "snapshots" / commit
    return d if commit and d.is_dir() else None


def _pick(ref: str, d: Path, kind: str, file: str | None) -> Path | None:
    """What a snapshot holds for `kind` (the directory, or a .gguf file), every link resolving
    (a broken link: an evicted blob); None when incomplete."""
    if file is not None:
        return d / file if (d / file).is_file() else None
    if all((d / f).is_file() for f in _NEEDS[kind]) and any(
        f.is_file() for f in d.glob("*.safetensors")
    ):
        return d
    ggufs = sorted(f.name for f in d.glob("*.gguf") if f.is_file()) if kind == "model" else []
    if len(ggufs) > 1:
        raise MespError(
            f"{ref}: holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); name one as "
            f"{ref}/FILE.gguf"
        )
    return d / ggufs[0] if ggufs else None


def local_path(ref: str, kind: str = "model") -> Path | None:
    """The directory (or .gguf file) a Hub id names (`kind`: "model" or "adapter"), from the
    cache or just downloaded; None when `ref` is an existing path or no Hub id. Raises
    MespError (one line) when it is neither cached nor downloadable."""
    parsed = None if Path(ref).expanduser().exists() else parse(ref)
    if parsed is None:
        return None
    d = snapshot(cache_dir(), parsed[0], parsed[1])
    got = _pick(ref, d, kind, parsed[2]) if d is not None else None
    return got or _download(ref, parsed, cache_dir(), kind)


def adapter_dir(ref: str) -> Path:
    """`--adapter`: a PEFT adapter directory, or a Hub id of one."""
    return local_path(ref, "adapter") or Path(ref)


def _download(ref: str, parsed: tuple[str, str | None, str | None], cache: Path, kind: str) -> Path:
    repo, rev, file = parsed
    what = f"{repo} {file}" if file else repo  # as `hf download` takes it
    why = ""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        why, how = "HF_HUB_OFFLINE is set", f"`hf download {what}` where online"
    else:
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            why = "huggingface_hub is not installed"
            how = f"`pip install huggingface_hub && hf download {what}`"
    if why:
        raise MespError(
            f"{ref}: not in the Hugging Face cache ({cache}) and {why}; download it with "
            f"{how}, or pass a local path"
        )
    print(f"mesp: {ref}: not in {cache}; downloading it from the Hugging Face Hub", file=sys.stderr)
    try:
        got = snapshot_download(
            repo,
            revision=rev,
            cache_dir=str(cache),
            allow_patterns=[file] if file else _FETCH[kind],
        )
    except Exception as e:  # no such repository, gated, no network: the library's own words
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MespError(f"{ref}: could not download from the Hugging Face Hub ({line})") from None
    picked = _pick(ref, Path(got), kind, file)
    if picked is None:
        needs = f"{', '.join(_NEEDS[kind])} with .safetensors" + (
            f", or a .gguf file named as {repo}/FILE.gguf" if kind == "model" else ""
        )
        raise MespError(f"{ref}: the Hub repository has no {kind} that mesp reads ({needs})")
    return picked
