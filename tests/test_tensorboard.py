"""`mesp train --tensorboard DIR`: the event files, read back by TensorBoard's own reader,
hold log.jsonl's numbers under their tags, continue across a resume, and come from rank 0
only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mesp.cli import main
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

FLAGS = dict(quantize="none", seq_len=40, batch_size=2, warmup=0, eval_batches=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tb")
    return make_model_dir(root / "m", "qwen2"), make_jsonl(root / "d.jsonl", 30)


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> (step, value) in order, as TensorBoard shows the directory (purges applied)."""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _tag(key: str) -> str:
    if key.startswith("valid_"):
        return "valid/" + key.removeprefix("valid_")
    return ("memory/" if key.endswith("_mb") else "train/") + key


def _from_log(out: Path) -> dict[str, list[tuple[int, float]]]:
    """What the event files must hold: log.jsonl's numbers under their tags, as float32."""
    want: dict[str, list[tuple[int, float]]] = {}
    for row in map(json.loads, (out / "log.jsonl").read_text().splitlines()):
        for k, v in row.items():
            if k != "step" and not isinstance(v, str):
                want.setdefault(_tag(k), []).append((row["step"], float(np.float32(v))))
    return want


def _steps(points: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in points]


def test_scalars_match_log_jsonl(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    out, tb = tmp_path / "ad", tmp_path / "tb"
    argv = train_argv(*tiny, out, "--tensorboard", str(tb), steps=4, eval_every=2, **FLAGS)
    assert main(argv) == 0
    got = _scalars(tb)
    assert {
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "memory/peak_rss_mb",
        "valid/loss",
        "valid/ppl",
    } <= set(got)
    assert got == _from_log(out)
    assert _steps(got["train/loss"]) == [1, 2, 3, 4] and _steps(got["valid/ppl"]) == [2, 4]


def test_resume_continues_the_steps(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """The resume writes a second event file; steps 1-2 stay, 3-4 follow. A stale step 3 in
    between (what a run killed after its last checkpoint leaves) is dropped by the resume's
    START, as the resume logs that step again."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    out, tb = tmp_path / "ad", tmp_path / "tb"
    assert main(train_argv(*tiny, out, "--tensorboard", str(tb), steps=2, **FLAGS)) == 0
    stale = EventFileWriter(str(tb))
    value = summary_pb2.Summary.Value(tag="train/loss", simple_value=99.0)
    stale.add_event(event_pb2.Event(step=3, summary=summary_pb2.Summary(value=[value])))
    stale.close()
    assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    assert len(list(tb.glob("events.out.tfevents.*"))) == 3
    got = _scalars(tb)
    assert _steps(got["train/loss"]) == [1, 2, 3, 4]
    assert got == _from_log(out)


def test_missing_package_is_one_line_before_loading(
    tiny: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboard"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard: ImportError
    out = tmp_path / "ad"
    argv = train_argv(tiny[0], tiny[1], out, "--tensorboard", str(tmp_path / "tb"), **FLAGS)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "mesp: error: --tensorboard needs the tensorboard package " + (
        "(pip install 'mesp[tensorboard]')"
    )
    assert not (out / "log.jsonl").exists() and not (tmp_path / "tb").exists()


def test_unwritable_dir_is_one_line_before_loading(
    tiny: tuple[Path, Path], tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "tb"
    argv = train_argv(*tiny, tmp_path / "ad", "--tensorboard", str(bad), **FLAGS)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mesp: error: {bad}: cannot write TensorBoard events (Not a directory)"
    assert not (tmp_path / "ad" / "log.jsonl").exists()


@pytest.mark.slow
def test_only_rank_zero_writes(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    out, tb = tmp_path / "ad", tmp_path / "tb"
    argv = train_argv(*tiny, out, "--tensorboard", str(tb), "--nproc", "2", python=True,
                      steps=3, eval_every=0, **FLAGS)  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    got = _scalars(tb)
    assert _steps(got["train/loss"]) == [1, 2, 3] and got == _from_log(out)
