"""`astrai train` under torchrun with two "nodes" on loopback: --nnodes 2, c10d rendezvous, gloo, CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ops.fakes import REPO


@pytest.mark.slow
def test_two_torchrun_launchers_train_one_run(tmp_path):
    from astrai.train.launch import free_port
    from astrai.train.publish import list_checkpoints, verify_checkpoint
    from tests.train.resume_data import read_metrics, write_run, write_tokenizer

    config = write_run(tmp_path / "run", write_tokenizer(tmp_path / "tok"), "sft", num_records=24, max_steps=3)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    launchers = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "ops-test",
               # node 0 hosts the rendezvous store; both on one machine, so say which one
               "--rdzv_conf", f"is_host={int(node == 0)}", "--local_addr", "127.0.0.1",
               "-m", "astrai", "train", "--config", str(config), "--parallel_mode", "ddp"]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115
        launchers.append((subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [p.wait(timeout=400) for p, _ in launchers]  # a failure guard; a run takes seconds
    finally:
        for p, log in launchers:
            if p.poll() is None:
                p.kill()
            log.close()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], logs

    (step, path), = list_checkpoints(tmp_path / "run" / "ckpt")
    verify_checkpoint(path)
    state = json.loads((path / "trainer_state.json").read_text())
    assert step == 3 and state["step"] == 3 and state["world_size"] == 2, logs
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]
