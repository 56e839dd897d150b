"""benchmarks/gpu_check.py on a CPU: its quick mode runs end to end with tiny models and writes
one JSON row per path, so its first GPU run does not die on a typo; a broken row prints its
traceback and the run goes on."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_quick_cpu_rows_in_process(gpu_check, tmp_path, capsys):
    out = tmp_path / "q.json"
    code = gpu_check.main(["--dry_run", "--in_process", "--rows", "sft_1b,generate_cuda_graphs,ddp_1",
                           "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert code == 0 and data["device"] == "cpu" and data["quick"] is True
    assert list(rows) == ["sft_1b", "generate_cuda_graphs", "ddp_1"]
    sft = rows["sft_1b"]
    assert sft["status"] == "ok" and sft["astrai"] > 0 and sft["peer"] > 0 and sft["unit"] == "tok/s"
    assert sft["ratio"] == pytest.approx(sft["astrai"] / sft["peer"]) and sft["mfu"] is None  # no peak on cpu
    assert rows["generate_cuda_graphs"]["status"] == "skipped" and "CUDA-only" in rows["generate_cuda_graphs"]["reason"]
    assert rows["ddp_1"]["status"] == "ok" and rows["ddp_1"]["grads_equal"] and rows["ddp_1"]["backend"] == "gloo"
    printed = capsys.readouterr().out
    assert "sft_1b" in printed and "transformers Trainer" in printed


def test_a_broken_row_prints_its_traceback_and_the_run_goes_on(gpu_check, tmp_path, capsys, monkeypatch):
    def broken(args):
        raise KeyError("planted typo")

    def skipped(args):
        raise gpu_check.Skip("peer not installed")

    rows = {"broken": broken, "skipped": skipped, "ddp_1": gpu_check.ROWS["ddp_1"]}
    monkeypatch.setattr(gpu_check, "ROWS", rows)
    out = tmp_path / "b.json"
    code = gpu_check.main(["--dry_run", "--in_process", "--rows", "broken,skipped,ddp_1", "--out", str(out)])
    got = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert code == 1  # a failed row fails the run, after the rest ran
    assert got["broken"]["status"] == "failed" and "planted typo" in got["broken"]["traceback"]
    assert got["skipped"] == {**got["skipped"], "status": "skipped", "reason": "peer not installed"}
    assert got["ddp_1"]["status"] == "ok"
    printed = capsys.readouterr().out
    assert printed.index("KeyError") < printed.index("ddp_1")  # the traceback sits under its row


def test_an_isolated_rows_failure_carries_what_its_process_printed(gpu_check, monkeypatch):
    """A row whose worker crashed (a spawned gloo rank's abort) prints its message to the row
    process's output, not into the traceback the row wrote: the failed row carries both."""

    class FakeRowProcess:  # the row process: writes a failed row, printed a crash message
        pid = 0

        def __init__(self, cmd, **kwargs):
            out = Path(cmd[cmd.index("--out") + 1])
            out.write_text(json.dumps({"rows": [{"name": "ddp_2", "status": "failed", "traceback": "Traceback: spawn",
                                                 "seconds": 1.0}]}))

        def communicate(self, timeout=None):
            return "terminate called after throwing an instance of 'gloo::IoException'\n", None

    monkeypatch.setattr(gpu_check.subprocess, "Popen", FakeRowProcess)
    row = gpu_check.run_isolated("ddp_2", argparse.Namespace(row_timeout=10), ["--dry_run"])
    assert row["status"] == "failed" and row["traceback"].startswith("Traceback: spawn")
    assert "gloo::IoException" in row["traceback"]

def test_unknown_row_is_an_error_naming_the_choices(gpu_check):
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry_run", "--rows", "sft_2b"])


ROW_NAMES = ("sft_smollm2", "sft_1b", "generate", "generate_continuous", "generate_cuda_graphs", "generate_varlen",
             "serve_c32", "grpo", "ddp_1", "ddp_2", "pytest_cuda")


def test_the_row_list_is_the_scripts(gpu_check):
    assert list(gpu_check.ROWS) == list(ROW_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("name", ROW_NAMES)
def test_each_row_runs_in_quick_cpu_mode_in_its_own_process(gpu_check, tmp_path, name):
    """One test per row (the suite's workers take them side by side), each row in the child
    process the script gives it, as on a device."""
    out = tmp_path / "row.json"
    code = gpu_check.main(["--dry_run", "--budget", "1800", "--rows", name, "--out", str(out)])
    [row] = json.loads(out.read_text())["rows"]
    assert row["name"] == name
    assert code == 0 and row["status"] != "failed", row.get("traceback", row.get("reason"))
    if name in ("sft_smollm2", "sft_1b", "generate", "generate_continuous", "serve_c32", "grpo"):
        assert row["status"] == "ok" and row["astrai"] > 0 and row["peer"] > 0, row
    if name in ("generate_cuda_graphs", "generate_varlen"):
        assert row["status"] == "skipped"
    if name == "ddp_2":
        assert row["world_size"] == 2
    if name == "pytest_cuda":
        assert "skipped" in row["summary"]
