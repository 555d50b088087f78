"""Process-level peak memory: Linux RSS high-water mark, child-process runs, CUDA peak.

RSS only reflects tensor frees if glibc hands freed memory back to the kernel, which it does
not by default (large frees stay in the heap). FAITHFUL_MALLOC_ENV makes every block >= 64 KiB
its own mmap, unmapped on free, so RSS tracks live memory. glibc reads these variables at
startup, hence measurements run in a fresh child process via run_child().
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from mesp.errors import MespError

FAITHFUL_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
RESULT_PREFIX = "MESP_RESULT "
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)


def _status_bytes(field: str) -> int | None:
    """A 'kB' field of /proc/self/status in bytes; None where /proc is unavailable."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def rss_parts() -> dict[str, int]:
    """Current RSS split as the kernel counts it (RssAnon, RssFile, RssShmem of
    /proc/self/status), in bytes: "anon" is heap and tensors; "file" is pages of mapped files,
    the interpreter's shared libraries and any weight file still memory-mapped. {} where /proc
    is unavailable (not Linux)."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return {}
    fields = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[fields[key]] = int(value.split()[0]) * 1024
    return out


def peak_rss_bytes() -> int:
    """Peak resident set size (VmHWM) since start or the last successful reset_peak_rss()."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # no /proc: lifetime peak only
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def current_rss_bytes() -> int:
    """Current resident set size (VmRSS)."""
    rss = _status_bytes("VmRSS")
    if rss is None:
        raise MespError("cannot read current RSS: /proc/self/status is unavailable")
    return rss


def reset_peak_rss() -> bool:
    """Set VmHWM to the current RSS (writes '5' to /proc/self/clear_refs, Linux >= 4.0).
    False when not permitted or absent: peak_rss_bytes() is then the lifetime peak, so use
    one fresh child process per measurement instead."""
    try:
        with _CLEAR_REFS.open("w") as f:
            f.write("5")
    except OSError:  # PermissionError, FileNotFoundError, EINVAL on old kernels
        return False
    return True


def report(**fields: Any) -> None:
    """Child side of run_child(): print the result as the one line the parent parses."""
    print(RESULT_PREFIX + json.dumps(fields), flush=True)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_child(
    argv: list[str],
    env_extra: dict[str, str] | None = None,
    timeout: float = 600.0,
    cwd: str | None = None,
    faithful_malloc: bool = True,
) -> dict[str, Any]:
    """Run `python *argv` with FAITHFUL_MALLOC_ENV (unless `faithful_malloc` is False: timing
    rows, where returning every free to the kernel turns temporaries into page faults; then
    those variables are removed, even where this process inherited them) and mesp importable;
    return the dict the child passed to report(). Raises MespError with the child's last
    stderr line on failure."""
    env = dict(os.environ)
    for k in FAITHFUL_MALLOC_ENV:
        if faithful_malloc:
            env[k] = FAITHFUL_MALLOC_ENV[k]
        else:
            env.pop(k, None)
    env.update(env_extra or {})
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + path if path else "")
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        raise MespError(f"child timed out after {timeout:g}s: {_last_line(stderr or '')}") from e
    if proc.returncode != 0:
        raise MespError(f"child exited with {proc.returncode}: {_last_line(proc.stderr)}")
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not results:
        raise MespError(f"child reported no result: {_last_line(proc.stderr)}")
    try:
        result = json.loads(results[-1][len(RESULT_PREFIX) :])
    except json.JSONDecodeError as e:
        raise MespError(f"child result is not valid JSON: {e}") from e
    if not isinstance(result, dict):
        raise MespError("child result is not a JSON object")
    return result


def cuda_peak_bytes(device: int | None = None) -> int | None:
    """torch.cuda.max_memory_allocated, or None without CUDA."""
    import torch  # lazy: keeps this module cheap to import in measuring children

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(device))


def reset_cuda_peak(device: int | None = None) -> None:
    """torch.cuda.reset_peak_memory_stats; a no-op without CUDA."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


__all__ = [
    "FAITHFUL_MALLOC_ENV",
    "cuda_peak_bytes",
    "current_rss_bytes",
    "peak_rss_bytes",
    "report",
    "reset_cuda_peak",
    "reset_peak_rss",
    "rss_parts",
    "run_child",
]
