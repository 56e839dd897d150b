"""Stand-ins for the host tools the operator scripts call: `docker`, `nvidia-smi`, `astrai`.

Each fake is a small Python script put first on PATH. `docker` and `astrai train` append one
JSON line per call (argv, environment) to a log file, so tests assert on the exact invocations
without a Docker engine, a GPU or a training run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_DOCKER = """\
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "docker", "argv": sys.argv[1:], "env": dict(os.environ)}) + "\\n")
if sys.argv[1:2] == ["info"] and os.environ.get("FAKE_DOCKER_DOWN"):
    print("Cannot connect to the Docker daemon at unix:///var/run/docker.sock", file=sys.stderr)
    sys.exit(1)
"""

FAKE_NVIDIA_SMI = """\
import os
for i in range(int(os.environ.get("FAKE_GPUS", "2"))):
    print(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})")
"""

# `astrai train` records its call and waits for SIGTERM when asked (to prove the exec);
# `astrai ckpt` answers FAKE_LATEST when set, else runs the real command
FAKE_ASTRAI = """\
import json, os, signal, sys, time
if sys.argv[1] == "ckpt":
    latest = os.environ.get("FAKE_LATEST")
    if latest is None:
        from astrai.cli import main
        sys.exit(main(sys.argv[1:]))
    if latest == "none":
        print("astrai ckpt latest: --resume found no checkpoint", file=sys.stderr)
        sys.exit(1)
    print(latest)
    sys.exit(0)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "astrai", "argv": sys.argv[1:], "pid": os.getpid(),
                        "env": dict(os.environ)}) + "\\n")
if os.environ.get("FAKE_WAIT_TERM"):
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(1))
    open(os.environ["FAKE_WAIT_TERM"], "w").write(str(os.getpid()))
    while not got:
        signal.pause()
    open(os.environ["FAKE_WAIT_TERM"] + ".stopped", "w").write("graceful")
"""


def install_fakes(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in [("docker", FAKE_DOCKER), ("nvidia-smi", FAKE_NVIDIA_SMI), ("astrai", FAKE_ASTRAI)]:
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return bin_dir


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: fakes first on PATH, the project importable, no CUDA/ASTRAI/NCCL leftovers."""
    bin_dir = install_fakes(tmp_path / "bin")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASTRAI_", "NCCL_", "FAKE_")) and k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(tmp_path / "calls.jsonl"),
               ASTRAI_PYTHON=sys.executable, HF_HUB_OFFLINE="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update(extra)
    return env


def calls(tmp_path: Path, tool: str = "docker") -> list[dict]:
    log = tmp_path / "calls.jsonl"
    if not log.exists():
        return []
    return [c for c in map(json.loads, log.read_text().splitlines()) if c["tool"] == tool]


def run_script(name: str, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / name), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def write_job(root: Path, infra: dict | None = None, trainer: dict | None = None, name: str = "train.yaml") -> Path:
    """A job directory: data/, base-model/ (with config.json) and the job file."""
    import yaml

    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "base-model").mkdir(exist_ok=True)
    (root / "base-model" / "config.json").write_text("{}")
    job = {"infra": {"job_name": "demo", "data_dir": "data", "model_dir": "base-model", **(infra or {})},
           **(trainer if trainer is not None else {"data": {"train_type": "sft", "data_path": "/data/train.jsonl"},
                                                    "train": {"max_steps": 10}})}
    path = root / name
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path
