"""benchmarks/bench_rl.py's plumbing on a tiny random HF model directory: `--model DIR` runs each
system in its own process on the same prompts and settings, both systems generate exactly the
new-token budget per completion (the same work), and the step's peak memory is measured from
the point where model and optimizer are loaded. SmolLM2 itself is never run here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rl.py"


@pytest.fixture(scope="module")
def bench_rl():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_rl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_rl"] = module
    spec.loader.exec_module(module)
    return module


def test_defaults_follow_the_workload(bench_rl, tmp_path):
    tiny = bench_rl.parse_args([])
    assert (tiny.steps, tiny.prompts, tiny.group_size, tiny.max_tokens, tiny.threads) == (8, 8, 8, 16, 1)
    (tmp_path / "config.json").write_text("{}")
    real = bench_rl.parse_args(["--model", str(tmp_path)])
    assert (real.steps, real.prompts, real.group_size, real.max_tokens, real.threads) == (3, 8, 4, 64, 2)
    assert bench_rl.parse_args(["--model", str(tmp_path), "--quick", "--max_tokens", "8"]).prompts == 2
    with pytest.raises(SystemExit):  # not a model directory
        bench_rl.parse_args(["--model", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit):
        bench_rl.parse_args(["--systems", "astrai,vllm"])


def test_step_memory_counts_what_the_step_allocates(tmp_path):
    # in a fresh interpreter: in the suite's process, memory that earlier tests freed but glibc kept
    # resident can hold the 64 MB block without the RSS growing (seen once: a step of 0 MB)
    probe = f"""
import json, sys
import torch
sys.path.insert(0, {str(SCRIPT.parent)!r})
from trl_common import StepMemory
memory = StepMemory()
memory.start()
block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
memory.tick()
del block
print(json.dumps(memory.summary()))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["step_rss_mb"] >= 48 and summary["peak_rss_mb"] >= summary["load_rss_mb"] + 48


@pytest.mark.slow
def test_model_dir_runs_astrai_and_trl_on_the_same_work(bench_rl, tmp_path, capsys):
    model_dir = tmp_path / "model"
    bench_rl.write_tiny_model(model_dir, ["12+34=46", "5+6=11"] * 20, seed=0)
    out = tmp_path / "bench.json"
    code = bench_rl.main(["--model", str(model_dir), "--steps", "2", "--prompts", "2", "--group_size", "2",
                          "--max_tokens", "5", "--systems", "astrai,trl", "--json", str(out)])
    data = json.loads(out.read_text())
    results = data["results"]
    assert code == 0 and list(results) == ["astrai", "trl"] and data["settings"]["model"] == str(model_dir)
    for r in results.values():  # 2 prompts x 2 completions x exactly 5 new tokens in both systems
        assert r["tokens_per_step"] == 20
        assert r["step_s"] > 0 and r["cpu_s"] > 0 and r["peak_rss_mb"] >= r["load_rss_mb"] > 0
    printed = capsys.readouterr().out
    assert "| astrai online_grpo |" in printed and "| TRL GRPOTrainer, checkpointing off |" in printed
    assert "on model:" in printed


def test_server_rows_get_their_own_table(bench_rl, capsys):
    row = {"step_s": 2.0, "cpu_s": 1.0, "peak_rss_mb": 100.0, "step_rss_mb": 10.0}
    results = {"astrai": row, "astrai_server_bc": {**row, "step_s": 3.0, "sync_s": 0.25, "server_peak_rss_mb": 90.0}}
    bench_rl.print_table(results, bench_rl.parse_args(["--quick"]), "a tiny model")
    out = capsys.readouterr().out
    assert "| astrai online_grpo | 2.000 | 0.000 | 100 | - | 1.00 |" in out
    assert "| astrai online_grpo, rollouts from a server (broadcast transport) | 3.000 | 0.250 | 100 | 90 | 1.50 |" in out
