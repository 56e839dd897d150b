"""Local multi-process launcher: `astrai train --nprocs N` starts N ranks of this same command.

Each rank is `python -m astrai train <argv>` in the launcher's working directory, with RANK /
WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set (a free local port), exactly what
`torchrun` would give it, so the trainer has one code path for both. The launcher forwards
SIGTERM and SIGINT to the ranks (which stop at an agreed step and publish one checkpoint), waits
up to `stop_timeout` seconds after the signal, then kills what is left and returns non-zero. If
a rank fails, the others are stopped too. It returns 0 only when every rank exited 0. A launcher
killed outright (SIGKILL) leaves no rank behind: each gets SIGTERM from the kernel when its parent
dies (PR_SET_PDEATHSIG), its watchdog notices the changed parent pid too, and a rank blocked in a
collective is ended `stop_timeout` after the signal (train/signals.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from typing import Any

from astrai.train import signals

# after one rank fails, the others get this long to stop before they are killed (they may be
# blocked in a collective waiting for the dead rank and never reach a batch boundary)
FAILURE_GRACE_S = 20.0
POLL_S = 0.05


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(launcher_pid: int) -> None:
    """In the child before exec: get SIGTERM if the launcher dies (Linux), so no rank is orphaned.
    (Each rank's watchdog, train/signals.py, also notices a changed parent pid, and ends a rank still
    blocked `stop_timeout` seconds after the signal.)"""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
        os._exit(1)


def _rank_env(rank: int, nprocs: int, port: int, stop_timeout: float = 600) -> dict[str, str]:
    # ranks share the machine's cores: more threads than cores makes OpenMP spin and slows
    # every rank several-fold, so split the cores unless the user chose a thread count
    threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    return {
        "OMP_NUM_THREADS": threads,
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "ASTRAI_STOP_TIMEOUT": str(stop_timeout),  # the rank's watchdog exits this long after a signal
    }


def _send(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass


def launch(argv: list[str], nprocs: int, stop_timeout: float = 600, program: list[str] | None = None) -> int:
    """Run `python -m astrai train <argv>` as `nprocs` local ranks; the exit code of the whole run.

    `program` replaces `python -m astrai train` (tests run a stand-in rank).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if argv and argv[0] == "train":  # accept the full sub-command line as well
        argv = argv[1:]
    port = free_port()
    cmd = [*(program or [sys.executable, "-m", "astrai", "train"]), *argv]
    procs: list[subprocess.Popen] = []
    deadline: list[float] = []  # set by the first signal (or failure): kill after it
    num_sigint = 0

    def forward(signum: int, frame: Any) -> None:
        nonlocal num_sigint
        num_sigint += signum == signal.SIGINT
        _send(procs, signum)  # a second SIGINT reaches the ranks too, which then abort (exit 130)
        if not deadline:
            deadline.append(time.monotonic() + stop_timeout)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(nprocs):
            # own session: a terminal's Ctrl-C reaches only the launcher, which forwards it once
            # the launcher's working directory, so relative paths and `module:function` rewards
            # resolve in every rank as in the launcher (`python -m` puts it first on sys.path)
            # the rank's watchdog (train/signals.py) takes a change of its parent pid as the launcher's death
            env = {**_rank_env(rank, nprocs, port, stop_timeout), "ASTRAI_LAUNCHER_PID": str(os.getpid())}
            procs.append(subprocess.Popen(cmd, env=env, cwd=os.getcwd(),
                                          start_new_session=True, preexec_fn=partial(die_with_parent, os.getpid())))
        if signals.last_signal() is not None:  # a signal arrived while the ranks were starting
            forward(signals.last_signal(), None)
        return _wait(procs, deadline, stop_timeout)
    finally:
        _send(procs, signal.SIGKILL)  # only ranks still running (after an exception here)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(procs: list[subprocess.Popen], deadline: list[float], stop_timeout: float) -> int:
    failed_rank = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            bad = [(rank, c) for rank, c in enumerate(codes) if c != 0]
            if bad:
                print(f"astrai launch: rank {bad[0][0]} exited with {bad[0][1]}", file=sys.stderr)
                return exit_code(bad[0][1])
            return 0
        if failed_rank is None:
            failed = [rank for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                failed_rank = failed[0]
                print(f"astrai launch: rank {failed_rank} failed (exit {codes[failed_rank]}); stopping the others",
                      file=sys.stderr)
                _send(procs, signal.SIGTERM)
                grace = time.monotonic() + min(stop_timeout, FAILURE_GRACE_S)
                deadline[:] = [min(deadline[0], grace)] if deadline else [grace]
        if deadline and time.monotonic() > deadline[0]:
            alive = [rank for rank, c in enumerate(codes) if c is None]
            print(f"astrai launch: ranks {alive} still running after the stop timeout; killing them",
                  file=sys.stderr)
            _send(procs, signal.SIGKILL)
            for p in procs:
                p.wait()
            return 1
        time.sleep(POLL_S)


def exit_code(code: int) -> int:
    # a rank killed by signal N reports -N; the shell's convention is 128 + N
    return 128 - code if code < 0 else code
