"""Multi-process training on CPU (gloo): launcher SIGTERM, resume with another world size, DDP/FSDP2 parity.

The SIGTERM test runs the real `astrai train --nprocs 2` (fresh processes, as a user runs it).
The other runs go through a small fork server (this file run as a script): it imports torch and
astrai once, then forks the ranks of each run with the environment the launcher would set, which
saves a torch import per rank on a 2-core machine.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_ranks(argv: list[str], nprocs: int) -> list[int]:
    from astrai.cli import main
    from astrai.train.launch import _rank_env, free_port

    port = free_port()
    pids = []
    for rank in range(nprocs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphans on timeout
                if nprocs > 1:
                    os.environ.update(_rank_env(rank, nprocs, port))
                code = main(["train", *argv])
            finally:
                os._exit(code)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def _fork_server(runs: list[tuple[list[str], int]], cwd: Path) -> list[list[int]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, __file__, json.dumps(runs)], capture_output=True, text=True,
                       timeout=240, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _weights(run_dir: Path):
    from safetensors.torch import load_file

    from astrai.train.publish import latest_checkpoint

    return load_file(str(latest_checkpoint(run_dir / "ckpt") / "model.safetensors"))


def _assert_close(a, b, atol=1e-5):
    import torch

    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


@pytest.mark.slow
def test_sigterm_to_launcher_then_resume_with_1_and_2_ranks(tmp_path, tok_dir):
    from astrai.train.publish import list_checkpoints, verify_checkpoint
    from tests.train.resume_data import read_metrics, write_run

    flags = {"batch_per_device": 2, "n_epoch": 2, "stop_timeout": 120}
    cfg_a = write_run(tmp_path / "a", tok_dir, "sft", num_records=64, **flags)
    cfg_b = write_run(tmp_path / "b", tok_dir, "sft", num_records=64, **flags)
    # both ranks pause right after optimizer step 2 (the test hook) until the SIGTERM reaches them
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ASTRAI_PAUSE_AT": "step:2", "ASTRAI_PAUSE_FILE": str(tmp_path / "paused")}
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "astrai", "train", "--config", str(cfg_a), "--nprocs", "2",
             "--parallel_mode", "ddp"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 240  # a guard against a hung run, not the property under test
        while time.monotonic() < deadline and launcher.poll() is None and len(list(tmp_path.glob("paused.*"))) < 2:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=240)
    output = (tmp_path / "launcher.log").read_text()
    assert code == 0, output[-3000:]

    ckpts = list_checkpoints(tmp_path / "a" / "ckpt")
    assert len(ckpts) == 1, output[-2000:]  # exactly one checkpoint: the stop's
    stop_step, path = ckpts[0]
    verify_checkpoint(path)
    state = json.loads((path / "trainer_state.json").read_text())
    total = 2 * 64 // 4
    assert state["step"] == stop_step and state["world_size"] == 2
    assert stop_step == 2 < total, "the SIGTERM came while both ranks waited after step 2"
    assert [m["step"] for m in read_metrics(tmp_path / "a")] == list(range(1, stop_step + 1))
    assert f"stopped at step {stop_step}" in output

    shutil.copytree(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")
    shutil.copytree(tmp_path / "a" / "log", tmp_path / "b" / "log", dirs_exist_ok=True)
    # one rank with twice the per-device batch sees the same global batches as two ranks
    codes = _fork_server([
        (["--config", str(cfg_a), "--resume", "--batch_per_device", "4"], 1),
        (["--config", str(cfg_b), "--resume", "--parallel_mode", "ddp"], 2),
    ], tmp_path)
    assert codes == [[0], [0, 0]]
    for run in ("a", "b"):
        steps = [m["step"] for m in read_metrics(tmp_path / run)]
        assert steps == list(range(1, total + 1)), run
    _assert_close(_weights(tmp_path / "a"), _weights(tmp_path / "b"))


@pytest.mark.slow
def test_ddp_and_fsdp_2x4_match_1x8(tmp_path, tok_dir):
    from tests.train.resume_data import read_metrics, write_run

    runs = {}
    for name, bs in (("one", 8), ("ddp", 4), ("fsdp", 4)):
        runs[name] = write_run(tmp_path / name, tok_dir, "sft", num_records=32, batch_per_device=bs,
                               max_steps=3, grad_accum_steps=1)
    codes = _fork_server([
        (["--config", str(runs["one"])], 1),
        (["--config", str(runs["ddp"]), "--parallel_mode", "ddp"], 2),
        (["--config", str(runs["fsdp"]), "--parallel_mode", "fsdp"], 2),
    ], tmp_path)
    assert codes == [[0], [0, 0], [0, 0]]
    reference = _weights(tmp_path / "one")
    ref_losses = [m["loss"] for m in read_metrics(tmp_path / "one")]
    for name in ("ddp", "fsdp"):
        _assert_close(_weights(tmp_path / name), reference)
        losses = [m["loss"] for m in read_metrics(tmp_path / name)]
        assert losses == pytest.approx(ref_losses, rel=1e-5), name

    # the sharded optimizer state went through a full (gathered) checkpoint: resuming it under
    # FSDP continues like the single process does
    codes = _fork_server([
        (["--config", str(runs["one"]), "--resume", "--max_steps", "5"], 1),
        (["--config", str(runs["fsdp"]), "--parallel_mode", "fsdp", "--resume", "--max_steps", "5"], 2),
    ], tmp_path)
    assert codes == [[0], [0, 0]]
    assert [m["step"] for m in read_metrics(tmp_path / "fsdp")] == [1, 2, 3, 4, 5]
    _assert_close(_weights(tmp_path / "fsdp"), _weights(tmp_path / "one"))
    # the FSDP checkpoint holds full (unsharded) tensors, loadable by one process
    import astrai
    from astrai.train.publish import latest_checkpoint

    model = astrai.load_model(latest_checkpoint(tmp_path / "fsdp" / "ckpt"))
    assert model.model.embed_tokens.weight.shape[0] == 320


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - the optimizer imports it lazily; once here, not per rank

    import astrai.data.datasets  # noqa: F401
    import astrai.train.trainer  # noqa: F401

    results = [_run_ranks(argv, nprocs) for argv, nprocs in json.loads(sys.argv[1])]
    sys.stdout.write(json.dumps(results) + "\n")
