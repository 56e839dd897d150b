"""A launcher killed with SIGKILL leaves no rank behind, even ranks blocked in a collective.

The local launcher starts 2 stand-in ranks that install astrai's signal handlers (as `astrai
train` does first), join the gloo process group, write their pid and then block forever in a
receive from each other: the main thread is inside a collective, so Python's SIGTERM handler
never runs. The test waits for both pid files (an event, not a delay), SIGKILLs the launcher and
waits, with a generous bound, until both pids are gone: the parent-death signal reaches each
rank and its watchdog (train/signals.py) ends it `stop_timeout` seconds later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

RANK = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from astrai.train import signals

    signals.install_signal_handlers()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    open(os.path.join(sys.argv[1], f"rank{rank}.pid"), "w").write(str(os.getpid()))
    buf = torch.zeros(1)
    dist.recv(buf, src=1 - rank)  # both ranks wait on each other: stuck in a collective for good
""")

LAUNCHER = textwrap.dedent("""
    import sys
    from astrai.train.launch import launch

    sys.exit(launch([sys.argv[2]], 2, stop_timeout=1.0, program=[sys.executable, sys.argv[1]]))
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(condition, bound_s: float, what: str) -> None:
    give_up = time.monotonic() + bound_s  # a bound on a hang, never a timing assertion
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.05)


def test_sigkilled_launcher_leaves_no_rank_running(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "rank.py"),
                                 str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
    pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
    try:
        _wait_for(lambda: all(f.exists() and f.read_text() for f in pid_files) or launcher.poll() is not None,
                  120, "the ranks never started")
        assert launcher.poll() is None, launcher.stderr.read()
        pids = [int(f.read_text()) for f in pid_files]
        assert all(_alive(p) for p in pids)
        launcher.kill()  # SIGKILL: no handler runs, nothing is forwarded
        launcher.wait()
        _wait_for(lambda: not any(_alive(p) for p in pids), 60, f"ranks {pids} outlived the launcher")
    finally:
        for f in pid_files:
            if f.exists() and f.read_text() and _alive(int(f.read_text())):
                os.kill(int(f.read_text()), signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
