"""`mesp train --nproc N`: torchrun's elastic agent, run in a child process (`python -m
mesp.training.launch REPORT <torchrun flags> -m mesp train ...`), its failures back as data.

- The rendezvous port is free per launch (`--standalone`: the agent's store binds port 0)
  unless `--master-port` names one; a fixed port collides with any other run on the machine.
- Rank 0 keeps the console (its progress bar stays live); every other rank's stdout and stderr
  go to its own file, `LOG_DIR/<run>/attempt_0/<rank>/stderr.log`, so a rank that dies leaves
  its own last words (the native abort message, and faulthandler's Python stack: the ranks run
  with PYTHONFAULTHANDLER=1 and TORCH_SHOW_CPP_STACKTRACES=1).
- When a rank fails, the agent writes REPORT (JSON: each failed rank, its exit status, its
  log) and the launcher ends with one line naming the rank that failed first, how it ended
  (exit status or signal) and where its output is, after that log's last lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TAIL_LINES = 25


def torchrun_argv(nproc: int, port: int, log_dir: Path, report: Path, argv: list[str]) -> list[str]:
    """The agent's command line: torchrun's own flags after REPORT."""
    cmd = [
        sys.executable,
        "-m",
        "mesp.training.launch",
        str(report),
        "--nproc-per-node",
        str(nproc),
    ]
    cmd += ["--master-port", str(port)] if port else ["--standalone"]
    cmd += ["--log-dir", str(log_dir)]
    if nproc > 1:  # ranks 1..N-1 into files: "-r 1:3,2:3" (3 = stdout and stderr)
        cmd += ["--redirects", ",".join(f"{r}:3" for r in range(1, nproc))]
    return [*cmd, "-m", "mesp", *argv]


def run_ranks(nproc: int, port: int, log_dir: Path, argv: list[str]) -> tuple[int, str]:
    """Run the ranks; (torchrun's exit code, '' or what failed: rank, how, where its log is).
    SIGINT / SIGTERM / SIGHUP here are passed to the agent, which stops the ranks (they save)
    and exits; then REPORT is removed and the code is 128 + the signal (SIGHUP as SIGTERM).
    Their default actions ended this process at once, leaving an empty REPORT in the temp dir
    and the agent running."""
    env = {"PYTHONFAULTHANDLER": "1", "TORCH_SHOW_CPP_STACKTRACES": "1", **os.environ}
    got: list[int] = []  # signals received
    sent: list[int] = []  # and passed on
    agent: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        signum = signal.SIGTERM if signum == signal.SIGHUP else signum
        got.append(signum)
        if agent is not None:
            agent.send_signal(signum)
            sent.append(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    report, text = None, ""
    try:
        fd, name = tempfile.mkstemp(prefix="mesp-ranks-", suffix=".json")
        os.close(fd)
        report = Path(name)
        if not got:
            # its own session: a terminal's ^C reaches the agent once, through forward()
            cmd = torchrun_argv(nproc, port, log_dir, report, argv)
            agent = subprocess.Popen(cmd, env=env, start_new_session=True)
            if got and not sent:  # arrived while it started
                agent.send_signal(got[0])
            rc = agent.wait()
            text = report.read_text()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if report is not None:
            report.unlink(missing_ok=True)
    if got:
        return 128 + got[0], ""
    return rc, (describe(json.loads(text)) if text else "")


def how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def last_words(lines: list[str]) -> list[str]:
    """From just above faulthandler's 'Fatal Python error' (where the native message, e.g.
    'terminate called after throwing ...', is) through the aborting thread's stack; else the
    log's last lines."""
    fatal = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    if not fatal:
        return lines[-TAIL_LINES:]
    start = max(fatal[-1] - 3, 0)
    return lines[start : start + 2 * TAIL_LINES]


def describe(report: dict) -> str:
    """Print the first failed rank's last log lines; return the one-line summary."""
    first, *rest = report["failures"]
    where = "its output is above"  # rank 0 writes to the console
    if first["log"] and Path(first["log"]).is_file():
        tail = last_words(Path(first["log"]).read_text(errors="replace").splitlines())
        print("".join(f"[rank{first['rank']}]: {ln}\n" for ln in tail), end="", file=sys.stderr)
        where = f"its output is in {first['log']}"
    then = "".join(f"; then rank {f['rank']} {how_it_ended(f['exitcode'])}" for f in rest)
    return f"rank {first['rank']} {how_it_ended(first['exitcode'])}; {where}{then}"


def _log_of(log_dir: str, local_rank: int) -> str:
    """The newest `LOG_DIR/<run>/attempt_<n>/<local_rank>/stderr.log` ('' for a console rank):
    torchrun's failure record names no log, and none for a rank killed by a signal."""
    logs = Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log")
    return str(max(logs, key=lambda p: p.stat().st_mtime, default=""))


def _agent(report: Path, args: list[str]) -> int:
    """torchrun's main, with its ChildFailedError kept as REPORT."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    ns = parse_args(args)
    try:
        run(ns)
    except SignalException as e:  # forwarded by run_ranks; the ranks were stopped with it
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # timestamps are whole seconds: within one, a rank killed by a signal came first
        failed = sorted(e.failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode >= 0))
        rows = [{"rank": r, "exitcode": f.exitcode, "log": _log_of(ns.log_dir, f.local_rank)}
                for r, f in failed]  # fmt: skip
        report.write_text(json.dumps({"failures": rows}))
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_agent(Path(sys.argv[1]), sys.argv[2:]))
