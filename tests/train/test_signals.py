"""Signal handling (stop requests, early signals, second SIGINT) and the local launcher's mechanics.

The launcher runs stand-in ranks here (small Python scripts), so these tests check its own
behaviour (environment, forwarding, timeouts, failures) in seconds; the end-to-end run with
real training ranks lives in test_dist_train.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from astrai.train import launch as launch_mod
from astrai.train import signals
from astrai.train.context import TrainContext


@pytest.fixture
def handlers():
    yield
    signals.uninstall_signal_handlers()


def test_sigterm_and_sigint_request_a_stop(handlers):
    ctx = TrainContext()
    assert signals.install_signal_handlers(ctx)
    os.kill(os.getpid(), signal.SIGTERM)
    assert ctx.stop_requested and ctx.stop_reason == "signal SIGTERM"
    ctx2 = TrainContext()
    signals.attach(ctx2)
    os.kill(os.getpid(), signal.SIGINT)  # the first SIGINT is a graceful stop, not KeyboardInterrupt
    assert ctx2.stop_requested and ctx2.stop_reason == "signal SIGINT"


def test_signal_before_context_is_remembered(handlers):
    signals.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGTERM)
    ctx = TrainContext()
    assert not ctx.stop_requested
    signals.attach(ctx)
    assert ctx.stop_requested and signals.last_signal() == signal.SIGTERM


def test_uninstall_restores_previous_handlers(handlers):
    before = signal.getsignal(signal.SIGTERM)
    signals.install_signal_handlers(TrainContext())
    signals.install_signal_handlers(TrainContext())  # twice: the original is still what comes back
    signals.uninstall_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) is before


def test_install_off_main_thread_is_a_noop(handlers):
    result = []
    t = threading.Thread(target=lambda: result.append(signals.install_signal_handlers(TrainContext())))
    t.start()
    t.join()
    assert result == [False]


def test_second_sigint_exits_130_at_once(tmp_path):
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from astrai.train import signals
        from astrai.train.context import TrainContext
        ctx = TrainContext()
        signals.install_signal_handlers(ctx)
        os.kill(os.getpid(), signal.SIGINT)
        assert ctx.stop_requested
        print("first handled", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("not reached", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130
    assert "first handled" in r.stdout and "not reached" not in r.stdout
    assert "second SIGINT" in r.stderr


# ------------------------------------------------------------------------------ launcher

RANK_SCRIPT = """
import json, os, signal, sys, time
out = sys.argv[1]
mode = sys.argv[2]
rank = int(os.environ["RANK"])
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append("TERM"))
signal.signal(signal.SIGINT, lambda s, f: got.append("INT"))
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(out, f"ready{rank}"), "w").write(json.dumps(env))
if mode == "fail" and rank == 1:
    sys.exit(3)
# "exit" leaves at once; the others wait for a signal as long as it takes (the test's timeout guards)
while mode != "exit" and not got:
    time.sleep(0.02)
open(os.path.join(out, f"done{rank}"), "w").write(",".join(got))
sys.exit(0)
"""


def _launch(tmp_path: Path, mode: str, nprocs: int = 2, stop_timeout: float = 30, signum: int | None = None):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)

    def send_when_ready():
        while len(list(tmp_path.glob("ready*"))) < nprocs:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    if signum is not None:
        threading.Thread(target=send_when_ready, daemon=True).start()
    code = launch_mod.launch([str(tmp_path), mode], nprocs, stop_timeout, program=[sys.executable, str(script)])
    return code, None


def test_launch_sets_rank_environment_and_returns_0(tmp_path):
    import json

    code, _ = _launch(tmp_path, "exit", nprocs=3)
    assert code == 0
    envs = [json.loads((tmp_path / f"ready{r}").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_ADDR"] == "127.0.0.1"


@pytest.mark.parametrize("signum, name", [(signal.SIGTERM, "TERM"), (signal.SIGINT, "INT")])
def test_launch_forwards_signals(tmp_path, signum, name):
    before = signal.getsignal(signal.SIGTERM)
    code, _ = _launch(tmp_path, "wait", signum=signum)
    assert code == 0
    assert [(tmp_path / f"done{r}").read_text() for r in range(2)] == [name, name]
    assert signal.getsignal(signal.SIGTERM) is before  # the launcher restores the handlers


def test_launch_kills_ranks_after_stop_timeout(tmp_path):
    code, _ = _launch(tmp_path, "ignore", stop_timeout=1.0, signum=signal.SIGTERM)
    assert code != 0
    assert not list(tmp_path.glob("done*"))  # killed (they ignore SIGTERM and would wait forever)


def test_launch_stops_the_others_when_a_rank_fails(tmp_path):
    code, _ = _launch(tmp_path, "fail")
    assert code == 3
    assert (tmp_path / "done0").read_text() == "TERM"  # rank 0 (waiting for a signal) was told to stop
