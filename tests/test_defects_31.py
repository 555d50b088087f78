"""Defects found trying mesp as a new user would (issue 31): each ended in a traceback, did
the wrong thing silently, or left something behind."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mesp.cli import main
from mesp.data import DataConfig, load_jsonl, load_splits
from mesp.errors import MespError
from mesp.loading.tokenizer import Tokenizer as MespTokenizer
from mesp.training.checkpoint import load_state
from tests.test_gguf_export import _base, _fails
from tests.tiny_dir import make_jsonl, make_model_dir, make_tokenizer, train_argv


def test_merge_to_gguf_without_bpe_merges_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A byte-level BPE tokenizer.json with no merges: llama.cpp cannot load such a GGUF (it
    requires tokenizer.ggml.merges) and gguf's writer cannot store an empty list, so the merge
    refuses in one line (it ended in gguf's 'Empty array' traceback) and writes no file."""
    base = _base(tmp_path, "qwen2")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(sorted(alphabet) + ["<|end|>", "<eos>"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(base / "tokenizer.json"))
    argv = ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad")]
    _fails([*argv, "--out", str(tmp_path / "m.gguf")], capsys, "no BPE merges", "--out DIR")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("flag", [["--train-on", "all-assistant"], ["--mask-prompt"]])
def test_reply_only_flags_refuse_text_rows_naming_the_row(
    flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--train-on all-assistant / --mask-prompt train only replies: on a {"text"} row they
    trained every token and said nothing; now one line names FILE:LINE."""
    model = make_model_dir(tmp_path / "m", "qwen2")
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"prompt": "q", "completion": " a"}) + "\n"
                    + json.dumps({"text": "To be, or not to be"}) + "\n")  # fmt: skip
    capsys.readouterr()
    assert main(train_argv(model, data, tmp_path / "ad", *flag, steps=1, seq_len=32)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mesp: error: {data}:2: {flag[0]}") and err.count("\n") == 1, err
    assert '{"text"} row' in err and not (tmp_path / "ad" / "adapter_model.safetensors").exists()


def test_reply_only_flags_keep_rows_that_have_replies_or_their_own_mask(tmp_path: Path) -> None:
    """prompt/completion rows mask their prompt; pre-tokenized rows with a loss_mask keep it;
    one without a loss_mask, and plain .txt data, are refused like text rows."""
    tok = MespTokenizer(backend=make_tokenizer(), eos_id=4)
    rows = tmp_path / "ok.jsonl"
    lines = [
        {"prompt": "To be", "completion": " or not"},
        {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]},
    ]
    rows.write_text("".join(json.dumps(r) + "\n" for r in lines))
    for kw in ({"mask_prompt": True}, {"train_on": "all-assistant"}):
        pc, ids = load_jsonl(rows, tok, 64, **kw)  # type: ignore[arg-type]
        assert 0 < pc.n_targets < len(pc.ids) - 1 and ids.mask == [0, 0, 1]
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    with pytest.raises(MespError, match=f'{bare}:1: --mask-prompt .* without "loss_mask"'):
        load_jsonl(bare, None, 64, mask_prompt=True, vocab_size=300)
    txt = tmp_path / "play.txt"
    txt.write_text("To be, or not to be, that is the question.\n" * 20)
    cfg = DataConfig(path=str(txt), train_on="last-assistant")
    with pytest.raises(MespError, match=f"{txt}: --train-on last-assistant .* plain text"):
        load_splits(cfg, tok)


def test_export_directory_and_files_get_the_umask_mode(tmp_path: Path) -> None:
    """`mesp export` builds its directory with mkdtemp (0700) and safetensors writes 0600: the
    artifacts were unreadable to every other user. Now 0777 / 0666 less the umask. (The files
    of export_model, through its Writer: a safetensors block file, a .pte, run_config.json;
    lowering real programs takes a minute, and the Writer is what sets the modes.)"""
    import torch
    from safetensors.torch import save_file

    from mesp.ondevice.artifact_files import Writer

    old = os.umask(0o022)
    try:
        out = tmp_path / "art"
        w = Writer(out)
        save_file({"w": torch.ones(3)}, str(w.path("blocks/block_000.safetensors")))
        w.path("pte/embed.pte").write_bytes(b"pte")
        w.path("run_config.json").write_text("{}")
        w.commit()
    finally:
        os.umask(old)
    paths = [out, *out.rglob("*")]
    assert len(paths) == 6
    for p in paths:
        want = 0o755 if p.is_dir() else 0o644
        assert stat.S_IMODE(p.stat().st_mode) == want, p


def _two_ranks_training(
    model: Path, data: Path, out: Path, env: dict[str, str]
) -> subprocess.Popen:
    """`mesp train --nproc 2` with no end in sight, once its first loss row is in the log."""
    argv = train_argv(
        model, data, out, "--nproc", "2", python=True, quantize="none", seq_len=40,
        batch_size=4, steps=100000, optimizer="sgd", eval_every=0, save_every=100000,
    )  # fmt: skip
    p = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
    log, deadline = out / "log.jsonl", time.time() + 300
    while (not log.exists() or '"loss"' not in log.read_text()) and time.time() < deadline:
        assert p.poll() is None, p.communicate()[1].decode()[-2000:]
        time.sleep(0.1)
    return p


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signalled_launcher_stops_its_ranks_and_leaves_no_report(
    sig: signal.Signals, tmp_path: Path
) -> None:
    """A signal to `mesp train --nproc 2` (SIGTERM from a supervisor, SIGINT from `kill -INT`)
    left an empty $TMPDIR/mesp-ranks-*.json behind, and the ranks never heard of it. It is
    passed on: the ranks save and stop, the report goes, and the launcher exits 128 + it."""
    model = make_model_dir(tmp_path / "m", "llama")
    data = make_jsonl(tmp_path / "d.jsonl", 30)
    tmp, out = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    p = _two_ranks_training(model, data, out, {**os.environ, "TMPDIR": str(tmp)})
    assert list(tmp.glob("mesp-ranks-*.json"))  # the report exists while the ranks run
    p.send_signal(sig)
    err = p.communicate(timeout=120)[1].decode()
    assert p.returncode == 128 + sig, err[-2000:]
    assert not list(tmp.glob("mesp-ranks-*")), err[-2000:]
    assert (out / "adapter_model.safetensors").exists()  # the ranks saved as they stopped
    left = subprocess.run(["pgrep", "-f", f"mesp.*{out}"], capture_output=True, text=True)
    assert not left.stdout.split(), left.stdout  # no agent or rank outlives the launcher


def _rank_pid(out: Path, rank: int) -> int | None:
    """The pid of `mesp train --nproc` rank `rank` writing to `out` (from its environment)."""
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in cmd and f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_one_step_and_rank_0_saves(
    tmp_path: Path,
) -> None:
    """A rank stopped on its own flag: a SIGTERM landing on rank 1 after a step's all-reduce
    stopped rank 1 at that step while rank 0 went on into the next all-reduce alone and died
    there, saving nothing (CI saw it as a launcher test that left no adapter under load). The
    ranks now stop where the all-reduce says one had a signal: both at one step, rank 0 saves.
    Rank 1 is signalled several times over a run, at whatever point of its step it is."""
    model = make_model_dir(tmp_path / "m", "llama")
    data = make_jsonl(tmp_path / "d.jsonl", 30)
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        p = _two_ranks_training(model, data, out, dict(os.environ))
        time.sleep(0.05 * attempt)  # a different point of the step each time
        pid = _rank_pid(out, 1)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        err = p.communicate(timeout=120)[1].decode()
        assert p.returncode != 0, err[-2000:]  # a rank ended by a signal: the run did not finish
        assert "exited with status 143" in err, err[-2000:]  # as a rank does on SIGTERM
        assert (out / "adapter_model.safetensors").exists(), err[-2000:]
        rows = [
            json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"loss"' in x
        ]
        assert load_state(out).step == rows[-1]["step"], err[-2000:]  # saved at the last step


QUIET = """
import logging, sys
from mesp.cli import main
assert main(["info", "--model", sys.argv[1]]) == 2  # sets up mesp's logging, then fails
import peft  # imports torchao, as `mesp bench`'s peft-gc variant and dropin do
logging.getLogger("mesp.bench").warning("own")
"""


def test_torchaos_import_noise_is_not_printed_as_mesp_warnings(tmp_path: Path) -> None:
    """`mesp bench` printed torchao's 'Failed to load ...so' and 'no triton' lines (and torch's
    pytree deprecation for torchao's enums) as `mesp: warning:` lines on every run; mesp's own
    warnings still print."""
    pytest.importorskip("torchao")
    r = subprocess.run(
        [sys.executable, "-c", QUIET, str(tmp_path / "none")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("mesp: error: ") and lines[1:] == ["mesp: warning: own"], lines


def test_the_runners_adapter_gets_the_umask_mode(tmp_path: Path) -> None:
    """`mesp run-artifacts` / mesp.runner wrote the trained adapter through mkstemp: 0600."""
    from mesp.ondevice import runner

    old = os.umask(0o022)
    try:
        runner.write_atomic(
            tmp_path / "adapter_model.safetensors", lambda p: Path(p).write_bytes(b"x")
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "adapter_model.safetensors").stat().st_mode) == 0o644
