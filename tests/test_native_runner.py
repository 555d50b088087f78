"""The native runner (runtime/, build/ondevice/mesp-runner): it builds against the executorch
wheel alone (no libtorch, no libpython in the binary), trains from `mesp export --target
executorch` artifacts, and refuses bad input with one line, exit code 2 and no adapter written.

Exactness against the engine and the Python ExecuTorch driver lives with those (the numbers);
here: the build, the CLI, the step lines, the adapter's format, and every bad input.
Artifacts: exported once per session from a tiny llama; MESP_ET_ARTIFACTS=DIR uses a prebuilt
export directory instead (copied, never modified).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "build" / "ondevice" / "mesp-runner"
STEP_LINE = re.compile(
    r"^step (\d+) loss (\d+\.\d{6,}|skipped \(no trained token\)) time \d+\.\d{3}s "
    r"peak_rss \d+\.\dMiB anon \d+\.\dMiB$"
)
SAVED_LINE = re.compile(
    r"^saved .+ after \d+ steps in \d+\.\d s; peak RSS \d+\.\d MiB \(anon \d+\.\d MiB, "
    r"polled every \d+ us\); "
    r"planned memory \d+\.\d MiB; \d+ threads$"
)


@pytest.fixture(scope="session")
def artifacts(et_cases) -> Path:  # type: ignore[no-untyped-def]
    """An export directory with an "executorch" section (read-only: tests copy it): the tiny
    4-bit Qwen2 that tests/test_ondevice_et.py also trains, or MESP_ET_ARTIFACTS=DIR."""
    given = os.environ.get("MESP_ET_ARTIFACTS")
    return Path(given) if given else et_cases("qwen2", "q4").dir


def _conf(d: Path) -> dict:
    return json.loads((d / "run_config.json").read_text())


def _rows(d: Path, n: int = 3) -> list[dict]:
    c = _conf(d)
    s, v = c["seq_len"], c["model"]["vocab_size"]
    return [
        {
            "input_ids": [(7 * i + 3 * t) % v for t in range(s + 1)],
            "loss_mask": [0, 0] + [1] * (s - 1),
        }
        for i in range(n)
    ]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _run(
    runner_bin: Path,
    art: Path,
    data: Path,
    out: Path,
    *extra: str,
    steps: int = 2,
    env: dict[str, str] | None = None,
):
    argv = [
        str(runner_bin),
        str(art),
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=600, env=env)


def _refused(r: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    """One error line, exit code 2, no adapter; the line says what went wrong."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mesp-runner: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not (out / "adapter_model.safetensors").exists()
    assert not (out / "adapter_config.json").exists()


def _fnv1a64(b: bytes) -> str:
    h = 0xCBF29CE484222325
    for x in b:
        h = ((h ^ x) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# ---- the build ----


def test_binary_links_no_libtorch_no_libpython(runner_bin: Path) -> None:
    if shutil.which("ldd") is None:
        pytest.skip("no ldd on this machine")
    deps = subprocess.run(
        ["ldd", str(runner_bin)], capture_output=True, text=True, check=True
    ).stdout
    assert "libexecutorch.so" in deps
    for bad in ("libtorch", "libc10", "libpython"):
        assert bad not in deps, deps
    assert "not found" not in deps, deps


def test_help_and_bad_flags(runner_bin: Path, tmp_path: Path) -> None:
    r = subprocess.run([str(runner_bin), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: mesp-runner" in r.stdout
    art, data, out = tmp_path / "nothing", tmp_path / "rows.jsonl", tmp_path / "out"
    for argv, needle in [
        ([], "missing the artifact directory"),
        ([str(art), "--steps", "1", "--out", str(out)], "--data is required"),
        ([str(art), "--data", str(data), "--steps", "1"], "--out is required"),
        ([str(art), "--data", str(data), "--out", str(out)], "--steps is required"),
        ([str(art), "--data", str(data), "--out", str(out), "--steps", "0"], "must be positive"),
        ([str(art), "--data", str(data), "--out", str(out), "--steps", "x"], "expected an integer"),
        (
            [str(art), "--data", str(data), "--out", str(out), "--steps", "1", "--lr", "-1"],
            "must be positive",
        ),
        (
            [str(art), "--data", str(data), "--out", str(out), "--steps", "1", "--lr", "nan"],
            "must be positive",
        ),
        (
            [
                str(art),
                "--data",
                str(data),
                "--out",
                str(out),
                "--steps",
                "1",
                "--optimizer",
                "sgdm",
            ],
            "sgd or adamw",
        ),
        (
            [
                str(art),
                "--data",
                str(data),
                "--out",
                str(out),
                "--steps",
                "1",
                "--weight-decay",
                "-1",
            ],
            "--weight-decay",
        ),
        (
            [str(art), "--data", str(data), "--out", str(out), "--steps", "1", "--bogus"],
            "unknown flag --bogus",
        ),
        (
            [str(art), "--data", str(data), "--out", str(out), "--steps", "1", "--lr"],
            "--lr needs a value",
        ),
        (
            [str(art), "--data", str(data), "--out", str(out), "--steps", "1"],
            "not an artifact directory",
        ),
    ]:
        _refused(
            subprocess.run([str(runner_bin), *argv], capture_output=True, text=True), out, needle
        )


# ---- a run ----


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_trains_and_saves_a_peft_adapter(
    runner_bin: Path, artifacts: Path, tmp_path: Path, optimizer: str
) -> None:
    from safetensors import safe_open

    data = _jsonl(tmp_path / "rows.jsonl", _rows(artifacts))
    out, log = tmp_path / "adapter", tmp_path / "log.jsonl"
    r = _run(
        runner_bin,
        artifacts,
        data,
        out,
        "--optimizer",
        optimizer,
        "--lr",
        "1e-3",
        "--json-log",
        str(log),
        "--threads",
        "1",
        steps=3,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4, r.stdout
    assert all(STEP_LINE.match(x) for x in lines[:3]), lines
    assert SAVED_LINE.match(lines[3]), lines[3]
    assert lines[3].endswith("; 1 threads"), lines[3]  # --threads 1: the pool it ran on
    steps = [json.loads(x) for x in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # memory accounting: after load, then before / after each program's first run, on step 1
    events = steps[0]["memory"]
    assert events[0]["at"] == "after load" and steps[1]["memory"] == steps[2]["memory"] == []
    firsts = [e["at"] for e in events[1:]]
    assert firsts[:2] == ["before first embed", "after first embed"] and len(firsts) % 2 == 0
    assert {"after first loss_start", "after first loss_slice", "after first loss_finish"} <= set(
        firsts
    )
    assert all(e["rss_anon_bytes"] > 0 and e["private_dirty_bytes"] > 0 for e in events)
    for s, line in zip(steps, lines[:3], strict=True):
        assert f"loss {s['loss']:.6f} " in line
    conf = _conf(artifacts)
    with safe_open(str(artifacts / conf["lora"]["init"]), "pt") as f:
        init = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert not f.metadata()  # as the Python runner and driver write it
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert set(got) == set(init)
    # where each step's time went: every program it ran, its calls and seconds (the warm-up's not)
    per_fn = Counter(b["fn"] for b in conf["blocks"])
    ran = {"embed", "loss_start", "loss_slice", "loss_finish", optimizer}
    ran |= {f"{g}.{k}" for g in per_fn for k in ("forward", "backward")}
    for s in steps:
        progs = s["programs"]
        assert ran <= set(progs) <= set(conf["executorch"]["programs"]), progs
        for g, n in per_fn.items():
            assert progs[f"{g}.forward"]["calls"] == progs[f"{g}.backward"]["calls"] == n
        assert progs["embed"]["calls"] == progs["loss_finish"]["calls"] == 1
        assert progs[optimizer]["calls"] == len(init)  # one call per LoRA tensor
        assert all(p["s"] >= 0 for p in progs.values())
        assert sum(p["s"] for p in progs.values()) <= s["time_s"]
    assert all(got[k].shape == init[k].shape and got[k].dtype == init[k].dtype for k in got)
    assert any(not (got[k] == init[k]).all() for k in got)  # it trained
    lora = conf["lora"]
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": lora["targets"],
        "base_model_name_or_path": conf["model"]["base_model"],
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    # Byte for byte what the Python runner's save_adapter() writes.
    assert (out / "adapter_config.json").read_text() == json.dumps(peft, indent=2)
    from safetensors.torch import save_file

    save_file(got, str(tmp_path / "py.safetensors"))
    assert (tmp_path / "py.safetensors").read_bytes() == (
        out / "adapter_model.safetensors"
    ).read_bytes()


def test_threads_default_to_omp_num_threads(
    runner_bin: Path, artifacts: Path, tmp_path: Path
) -> None:
    """Without --threads the pool takes OMP_NUM_THREADS (the knob torch reads for the engine) where
    it is a count, and ExecuTorch's own choice where it is unset or not one."""
    data = _jsonl(tmp_path / "rows.jsonl", _rows(artifacts))
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def pool(omp: str | None) -> str:
        env = base if omp is None else {**base, "OMP_NUM_THREADS": omp}
        r = _run(runner_bin, artifacts, data, tmp_path / f"a{omp}", steps=1, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()[-1].rsplit("; ", 1)[1]

    assert pool("1") == "1 threads" and pool("3") == "3 threads"
    own = pool(None)
    assert pool("0") == pool("two") == own, own


def test_no_trained_token_skips_the_step(runner_bin: Path, artifacts: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "rows.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}])
    out = tmp_path / "adapter"
    r = _run(runner_bin, artifacts, data, out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("step 1 loss skipped (no trained token) time ")
    assert (out / "adapter_config.json").is_file()


def test_checkpoints_on_disk_train_the_same(
    runner_bin: Path, artifacts: Path, tmp_path: Path
) -> None:
    """--checkpoints-dir: the block inputs go to a nameless scratch file there and come back in
    the backward (two stay resident instead of one per block, as the log's checkpoint_bytes
    says): the same losses and adapter to the bit, and nothing left in the directory. A
    directory it cannot write in is refused before any step, in one line."""
    data = _jsonl(tmp_path / "rows.jsonl", _rows(artifacts, 3))
    c = _conf(artifacts)
    one = 4 * c["batch_size"] * c["seq_len"] * c["model"]["hidden_size"]  # a block input, fp32
    runs, held = {}, {}
    for name, extra in (("memory", []), ("disk", ["--checkpoints-dir", str(tmp_path / "ck")])):
        (tmp_path / "ck").mkdir(exist_ok=True)
        out, log = tmp_path / name, tmp_path / f"{name}.jsonl"
        r = _run(runner_bin, artifacts, data, out, "--json-log", str(log), *extra, steps=3)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        runs[name] = ([o["loss"] for o in lines], (out / "adapter_model.safetensors").read_bytes())
        held[name] = {o["checkpoint_bytes"] for o in lines}
    assert runs["disk"] == runs["memory"]
    assert held == {"memory": {len(c["blocks"]) * one}, "disk": {2 * one}}
    assert list((tmp_path / "ck").iterdir()) == []
    out = tmp_path / "refused"
    r = _run(runner_bin, artifacts, data, out, "--checkpoints-dir", str(tmp_path / "nowhere"))
    _refused(r, out, "--checkpoints-dir", "nowhere", "cannot create a scratch file")


# ---- bad input: one line, exit code 2, no adapter ----


def _copy(artifacts: Path, tmp_path: Path) -> Path:
    d = tmp_path / "art"
    shutil.copytree(artifacts, d)
    return d


def _edit_conf(d: Path, edit) -> None:  # type: ignore[no-untyped-def]
    c = _conf(d)
    edit(c)
    (d / "run_config.json").write_text(json.dumps(c, indent=1))


def _rewrite_st(path: Path, export_id: str | None = None, reshape: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))["__metadata__"]
    t = load_file(str(path))
    if reshape is not None:
        t[reshape] = t[reshape].reshape(-1)
    save_file(t, str(path), metadata={**meta, **({"export_id": export_id} if export_id else {})})


def _pte(d: Path, prog: str = "sgd") -> Path:
    return d / _conf(d)["executorch"]["programs"][prog]["pte"]


def _block_file(d: Path, i: int = 0) -> Path:
    return d / _conf(d)["blocks"][i]["file"]


def _break_config_json(d: Path) -> None:
    (d / "run_config.json").write_text("{not json")


def _drop_executorch(d: Path) -> None:
    _edit_conf(d, lambda c: c.pop("executorch"))


def _truncate_pte(d: Path) -> None:
    p = _pte(d)
    p.write_bytes(p.read_bytes()[:-16])


def _flip_pte(d: Path) -> None:
    p = _pte(d)
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


def _refused_pte(d: Path) -> None:
    """Not a program at all, but with its size and hash recorded: ExecuTorch says no."""
    p = _pte(d)
    b = bytearray(p.read_bytes())
    b[4:8] = b"XXXX"  # the flatbuffer file identifier, "ET12"
    p.write_bytes(bytes(b))

    def fix(c: dict) -> None:
        c["executorch"]["programs"]["sgd"]["fnv1a64"] = _fnv1a64(bytes(b))

    _edit_conf(d, fix)


def _other_export_id(d: Path) -> None:
    _rewrite_st(d / "head.safetensors", export_id="0" * 32)


def _missing_block(d: Path) -> None:
    _block_file(d, len(_conf(d)["blocks"]) - 1).unlink()


def _tensor_mismatch(d: Path) -> None:
    p = _block_file(d)
    from safetensors import safe_open

    with safe_open(str(p), "pt") as f:
        name = next(k for k in f.keys() if len(f.get_slice(k).get_shape()) == 2)
    _rewrite_st(p, reshape=name)


def _truncate_block(d: Path) -> None:
    p = _block_file(d)
    p.write_bytes(p.read_bytes()[:-4])


def _missing_pte(d: Path) -> None:
    _pte(d, "loss_finish").unlink()


BAD_ARTIFACTS = {
    "no config": (lambda d: (d / "run_config.json").unlink(), ["run_config.json: missing"]),
    "malformed config": (_break_config_json, ["run_config.json: unreadable"]),
    "no executorch section": (_drop_executorch, ["export with --target executorch"]),
    "truncated pte": (_truncate_pte, ["sgd.pte", "truncated"]),
    "pte from another export": (_flip_pte, ["sgd.pte", "fnv1a64", "not from this export"]),
    "pte executorch refuses": (
        _refused_pte,
        ["sgd.pte", "ExecuTorch refused the program", "InvalidProgram"],
    ),
    "missing pte": (_missing_pte, ["loss_finish.pte", "missing"]),
    "export id differs": (_other_export_id, ["head.safetensors", "made by export 000", "mixed"]),
    "missing block file": (_missing_block, ["block_", "missing"]),
    "tensor not in table": (_tensor_mismatch, ["block_000", "run_config.json says"]),
    "truncated block file": (_truncate_block, ["block_000", "truncated"]),
}


@pytest.mark.parametrize("case", list(BAD_ARTIFACTS))
def test_bad_artifacts_are_refused(
    runner_bin: Path, artifacts: Path, tmp_path: Path, case: str
) -> None:
    d = _copy(artifacts, tmp_path)
    data = _jsonl(tmp_path / "rows.jsonl", _rows(d))
    breaker, needles = BAD_ARTIFACTS[case]
    breaker(d)
    out = tmp_path / "adapter"
    _refused(_run(runner_bin, d, data, out), out, *needles)


def _bad_rows(s: int, v: int) -> dict:
    ok = json.dumps({"input_ids": [1, 2, 3]})
    return {
        "not json": ([ok, "{nope"], ":2: not JSON"),
        "ids not a list": (['{"input_ids": 5}'], ':1: "input_ids" must be a list'),
        "id out of range": ([json.dumps({"input_ids": [1, v]})], f"token ids in 0..{v - 1}"),
        "id not an integer": (['{"input_ids": [1, 2.0]}'], '"input_ids" must be'),
        "id a boolean": (['{"input_ids": [1, true]}'], '"input_ids" must be'),
        "too long": (
            [ok, "", json.dumps({"input_ids": [1] * (s + 2)})],
            f":3: {s + 2} tokens; rows must have 2..{s + 1}",
        ),
        "too short": ([json.dumps({"input_ids": [1]})], ":1: 1 tokens"),
        "mask length": (
            [json.dumps({"input_ids": [1, 2], "loss_mask": [1]})],
            '"loss_mask" must be',
        ),
        "mask value": (
            [json.dumps({"input_ids": [1, 2], "loss_mask": [0, 2]})],
            '"loss_mask" must be',
        ),
        "no rows": (["", "  "], "no rows"),
    }


@pytest.mark.parametrize("case", list(_bad_rows(8, 10)))
def test_bad_rows_are_refused(runner_bin: Path, artifacts: Path, tmp_path: Path, case: str) -> None:
    c = _conf(artifacts)
    lines, needle = _bad_rows(c["seq_len"], c["model"]["vocab_size"])[case]
    data = _jsonl(tmp_path / "rows.jsonl", lines)
    out = tmp_path / "adapter"
    _refused(_run(runner_bin, artifacts, data, out), out, str(data), needle)


def test_missing_data_and_out_a_file(runner_bin: Path, artifacts: Path, tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    _refused(_run(runner_bin, artifacts, tmp_path / "none.jsonl", out), out, "none.jsonl")
    data = _jsonl(tmp_path / "rows.jsonl", _rows(artifacts))
    f = tmp_path / "file"
    f.write_text("x")
    r = _run(runner_bin, artifacts, data, f)
    assert (
        r.returncode == 2
        and r.stderr.startswith("mesp-runner: error: ")
        and "not a directory" in r.stderr
    )
    assert f.read_text() == "x"


def test_non_finite_loss_writes_no_adapter(
    runner_bin: Path, artifacts: Path, tmp_path: Path
) -> None:
    data = _jsonl(tmp_path / "rows.jsonl", _rows(artifacts))
    out = tmp_path / "adapter"
    r = _run(runner_bin, artifacts, data, out, "--lr", "1e30", steps=4)
    _refused(r, out, "non-finite loss at step", "no adapter written")
    assert not out.exists()


@pytest.mark.slow
def test_inside_a_hard_memory_cap(runner_bin: Path, artifacts: Path, tmp_path: Path) -> None:
    """The runner's steps inside a memory cgroup (mesp bench ondevice --memory-cap): charged to
    the group (its peak charge is its own, not 0) and done within the cap, the adapter written.
    The tiny export needs under 4 MB, the smallest cap run_capped takes, so the kill path is
    tests/test_memory_cap.py's (a process that does not fit)."""
    from mesp.errors import MespError
    from mesp.memory.cgroup import MB, memory_root, run_capped

    try:
        memory_root()
    except MespError as e:
        pytest.skip(str(e))
    data = _jsonl(tmp_path / "rows.jsonl", _rows(artifacts))
    argv = [str(runner_bin), str(artifacts), "--data", str(data), "--steps", "3"]
    argv += ["--out", str(tmp_path / "adapter"), "--threads", "1"]
    r = run_capped(argv, 64 * MB, timeout=300)
    assert r.ok and r.why().startswith("completed inside the 64 MB cap"), r.why()
    assert 0 < r.peak_bytes <= 64 * MB
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def test_reported_peak_holds_against_an_outside_poll(
    runner_bin: Path, artifacts: Path, tmp_path: Path
) -> None:
    """The peak anon the runner reports (its own thread reads RssAnon every 1 ms, inside the
    programs too) is never below what a 5 ms poll of /proc/PID/status from outside reads, less
    2% (issue 37: the old between-programs samples missed ~20 MB at 0.5B). --memory-poll-us 0
    leaves only those samples, and bad values are refused in one line."""
    from mesp.memory.poll import run_polled

    data = _jsonl(tmp_path / "rows.jsonl", _rows(artifacts))
    argv = [str(runner_bin), str(artifacts), "--data", str(data), "--steps", "3"]
    argv += ["--out", str(tmp_path / "adapter"), "--json-log", str(tmp_path / "log.jsonl")]
    r = run_polled(argv, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.samples > 0 and r.peak_anon_bytes > 0
    saved = r.stdout.splitlines()[-1]
    assert "polled every 1000 us" in saved, saved
    reported = float(re.search(r"\(anon ([0-9.]+) MiB", saved).group(1)) * 2**20  # type: ignore[union-attr]
    steps = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert max(s["anon_bytes"] for s in steps) <= reported + 0.05 * 2**20
    assert r.peak_anon_bytes <= 1.02 * reported + 0.05 * 2**20, (r.peak_anon_bytes, reported)

    r0 = _run(runner_bin, artifacts, data, tmp_path / "a0", "--memory-poll-us", "0")
    assert r0.returncode == 0 and "polled every 0 us" in r0.stdout, r0.stderr
    for bad in ("-1", "2000000", "x"):
        _refused(
            _run(runner_bin, artifacts, data, tmp_path / "bad", "--memory-poll-us", bad),
            tmp_path / "bad",
            "--memory-poll-us",
        )
