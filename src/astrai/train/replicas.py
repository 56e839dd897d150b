"""`astrai train --rollout_replicas N`: one command starts N local `astrai serve` replicas and the trainer.

The launcher process (``train/cli.py`` hands it the command line when ``rollout_replicas > 0``)
starts each replica as `python -m astrai serve` on a free loopback port, with the admin route on
(a fresh key, or ``rollout_admin_key`` / ``$ASTRAI_ADMIN_KEY``, passed in the environment, never
on a command line) and ``--weights_dir`` at the run's ``rollout_weights_dir``, and with settings
that make its batches reproducible (no probed prefill chunk, thread count or weight layout); it
waits until each answers `/health`, then starts the trainer as `python -m astrai train <the same
arguments> --rollout_servers URL,... --rollout_replicas 0 --rollout_weight_transport broadcast`
(which itself runs the local multi-rank launcher when ``nprocs > 1``): the launcher owns both ends,
so the weights go by the gloo group, with no file written per step. Devices: on CUDA replica i sees GPU i and the trainer the GPUs after
the replicas (``CUDA_VISIBLE_DEVICES``); on the CPU the cores are split between the processes.
Each process logs to ``<log_dir>/replica_<i>.log`` (the trainer to the launcher's own streams), and
``<log_dir>/replicas.json`` names every pid and URL.

Teardown: SIGTERM or SIGINT goes to the trainer, which stops at a step boundary and publishes a
checkpoint; when the trainer exits for any reason the replicas get SIGTERM (SIGKILL after
``REPLICA_GRACE_S``); a replica that dies stops the trainer (SIGTERM, then SIGKILL after
``stop_timeout``). Every child gets SIGTERM from the kernel if the launcher itself dies
(PR_SET_PDEATHSIG, as for the ranks of ``train/launch.py``). The servers start from the run's
``param_path``, or from a model directory written from the ``model:`` section: the trainer loads its
own weights into them before the first rollout.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from astrai.config import Config
from astrai.train import signals
from astrai.train.launch import POLL_S, die_with_parent, exit_code, free_port

HEALTH_TIMEOUT_S = 600.0  # a replica that is not healthy this long after its start is an error
REPLICA_GRACE_S = 10.0  # after SIGTERM, a replica is killed this long later


def initial_model_dir(cfg: Config) -> str:
    """What the servers load at start: param_path, or a fresh model of the ``model:`` section with
    the run's tokenizer (its weights are replaced by the trainer's before the first rollout)."""
    from astrai.train.build import build_tokenizer, resolve_param_path

    if cfg.train.param_path:
        return resolve_param_path(cfg.train.param_path)
    from astrai.model.config import ModelConfig
    from astrai.model.hf import save_model
    from astrai.model.transformer import CausalLM

    out = Path(cfg.log.log_dir) / "replicas" / "initial_model"
    save_model(CausalLM(ModelConfig.from_dict(cfg.model), seed=cfg.train.random_seed), out,
               tokenizer=build_tokenizer(cfg))
    return str(out)


def _devices(num_replicas: int) -> tuple[list[dict[str, str]], dict[str, str]]:
    """Per replica and for the trainer: the environment that places it (GPUs, or CPU threads)."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count <= num_replicas:
            raise ValueError(f"--rollout_replicas {num_replicas} needs {num_replicas + 1} GPUs or more (one per "
                             f"replica, then the trainer's), but {count} are visible; lower --rollout_replicas")
        trainer = ",".join(str(d) for d in range(num_replicas, count))
        return [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(num_replicas)], {"CUDA_VISIBLE_DEVICES": trainer}
    threads = str(max(1, (os.cpu_count() or 1) // (num_replicas + 1)))
    return [{"OMP_NUM_THREADS": threads} for _ in range(num_replicas)], {"OMP_NUM_THREADS": threads}


def _start(cmd: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen:
    out = open(log, "w") if log is not None else None  # noqa: SIM115 - the child holds it open
    try:
        return subprocess.Popen(cmd, env=env, cwd=os.getcwd(), stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True, preexec_fn=partial(die_with_parent, os.getpid()))
    finally:
        if out is not None:
            out.close()


def _wait_healthy(procs: list[subprocess.Popen], urls: list[str], logs: list[Path]) -> str | None:
    """None once every replica answers /health 200; else why not (one exited, time ran out, a signal)."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    pending = set(range(len(procs)))
    while pending:
        if signals.last_signal() is not None:
            return "a signal arrived while the replicas were starting"
        for i in sorted(pending):
            if procs[i].poll() is not None:
                return f"rollout replica {i} ({urls[i]}) exited with {procs[i].returncode} while starting; see {logs[i]}"
            try:
                if httpx.get(urls[i] + "/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            return f"rollout replicas {sorted(pending)} were not healthy after {HEALTH_TIMEOUT_S:.0f} s; see their logs"
        time.sleep(0.1)
    return None


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"astrai train: process {p.pid} did not exit within {grace:g} s of SIGTERM; killing it",
                  file=sys.stderr)
            p.kill()
            p.wait()


def launch_with_replicas(argv: list[str], cfg: Config) -> int:
    """Start the replicas, then the trainer; the trainer's exit code (1 when a replica failed)."""
    n = cfg.rl.rollout_replicas
    log_dir = Path(cfg.log.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    weights = Path(cfg.rl.rollout_weights_dir or log_dir / "rollout_weights")
    weights.mkdir(parents=True, exist_ok=True)
    key = cfg.rl.rollout_admin_key or os.environ.get("ASTRAI_ADMIN_KEY") or secrets.token_hex(16)
    model_dir = initial_model_dir(cfg)
    placement, trainer_env = _devices(n)
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [log_dir / f"replica_{i}.log" for i in range(n)]
    replicas: list[subprocess.Popen] = []
    trainer: subprocess.Popen | None = None
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(n):
            env = {**os.environ, **placement[i], "ASTRAI_ADMIN_KEY": key}
            cmd = [sys.executable, "-m", "astrai", "serve", "--model", model_dir, "--port", str(ports[i]),
                   "--weights_dir", str(weights), "--long_prefill_token_threshold", "0", "--linear_layout", "out_in",
                   "--num_threads", env.get("OMP_NUM_THREADS", "1"), "--log_level", "warning"]
            replicas.append(_start(cmd, env, logs[i]))
        _write_pids(log_dir, replicas, urls, logs, None)
        problem = _wait_healthy(replicas, urls, logs)
        if problem is not None:
            print(f"astrai train: {problem}", file=sys.stderr)
            return 1 if signals.last_signal() is None else 0
        cmd = [sys.executable, "-m", "astrai", "train", *argv, "--rollout_servers", ",".join(urls),
               "--rollout_replicas", "0", "--rollout_weights_dir", str(weights), "--rollout_weight_transport", "broadcast"]
        trainer = _start(cmd, {**os.environ, **trainer_env, "ASTRAI_ADMIN_KEY": key,
                               "ASTRAI_REPLICAS_ARGV": json.dumps(argv)}, None)
        _write_pids(log_dir, replicas, urls, logs, trainer)
        forward = partial(_forward, trainer)
        for s in previous:
            signal.signal(s, forward)
        if signals.last_signal() is not None:  # a signal came while the trainer was starting
            forward(signals.last_signal(), None)
        return _watch(trainer, replicas, urls, cfg.train.stop_timeout)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if trainer is not None:
            _stop([trainer], cfg.train.stop_timeout)
        _stop(replicas, REPLICA_GRACE_S)


def _write_pids(log_dir: Path, replicas: list[subprocess.Popen], urls: list[str], logs: list[Path],
                trainer: subprocess.Popen | None) -> None:
    info = {"replicas": [{"pid": p.pid, "url": u, "log": str(lg)} for p, u, lg in zip(replicas, urls, logs)],
            "trainer": {"pid": trainer.pid} if trainer is not None else None}
    (log_dir / "replicas.json").write_text(json.dumps(info, indent=1) + "\n")


def _forward(trainer: subprocess.Popen, signum: int, frame: Any) -> None:
    if trainer.poll() is None:
        trainer.send_signal(signum)


def _watch(trainer: subprocess.Popen, replicas: list[subprocess.Popen], urls: list[str], stop_timeout: float) -> int:
    """Until the trainer exits: a replica that dies stops the trainer (its code, or 1)."""
    while trainer.poll() is None:
        dead = [i for i, p in enumerate(replicas) if p.poll() is not None]
        if dead:
            i = dead[0]
            print(f"astrai train: rollout replica {i} ({urls[i]}) exited with {replicas[i].returncode}; stopping "
                  "the trainer", file=sys.stderr)
            _stop([trainer], stop_timeout)
            return 1
        time.sleep(POLL_S)
    return exit_code(trainer.returncode)
