"""The demos' stage runner: a stage cut short by a signal is never marked finished."""

from __future__ import annotations

import os
import signal

import pytest

from astrai.demo_stages import run_stage, stage_done
from astrai.train import signals


def test_a_stage_stopped_by_a_signal_is_not_marked_finished(tmp_path):
    """`astrai train` answers SIGTERM / Ctrl-C with a checkpoint and exit 0; the demo must not then
    publish the half-trained stage as finished (a re-run would reuse it) nor go on to the next."""
    logs: list[str] = []
    signals.install_signal_handlers()
    try:
        def stage() -> dict:
            os.kill(os.getpid(), signal.SIGTERM)
            while signals.last_signal() is None:  # the handler runs at the next bytecode boundary
                pass
            return {"steps": 3}

        with pytest.raises(SystemExit) as stopped:
            run_stage("sft", tmp_path / "sft", stage, logs.append)
        assert stopped.value.code == 128 + signal.SIGTERM
        assert stage_done(tmp_path / "sft") is None
        assert "stopped by SIGTERM" in logs[-1] and "run the demo again" in logs[-1]
    finally:
        signals.uninstall_signal_handlers()
    assert run_stage("sft", tmp_path / "sft", lambda: {"steps": 3}, logs.append)["steps"] == 3
    assert stage_done(tmp_path / "sft")["steps"] == 3
