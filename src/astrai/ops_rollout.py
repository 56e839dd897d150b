"""The rollout part of a training job file, for `scripts/train.sh` (through `astrai.ops`).

A job's `rl:` section may draw its rollouts from `astrai serve` processes (docs/training.md, Rollouts
from servers): `rollout_replicas: N` starts N local replicas inside the train container, on the
first N of the job's GPUs, the trainer's ranks on the rest; `rollout_servers: [URL, ...]` uses
servers started elsewhere (another node: `scripts/serve.sh --rollout up` there). The container then
joins the host's network (`docker/compose.rollout.yaml`): the servers are reached by their URLs, and
with the broadcast transport they connect back to the trainer's weight group on a free port of its
node. With the filesystem transport `rollout_weights_dir` is storage both nodes mount at the same
path, and the container mounts it there too. This module reads those fields as placement, the
variables compose and the entrypoint read, and the problems `preflight` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Rollout:
    """Where a job's rollouts come from (all defaults: the in-process engine)."""

    replicas: int = 0
    servers: list[str] = field(default_factory=list)
    transport: str = "filesystem"
    weights_dir: Path | None = None

    @property
    def external(self) -> bool:
        return bool(self.servers)


def read_rollout(path: Path, trainer: dict[str, Any]) -> Rollout:
    """The rollout fields of the job's `rl:` section (their values are checked by the trainer's own
    config parser in `prepare`; here only what placement needs, each error naming the key)."""
    rl = trainer.get("rl") or {}
    if not isinstance(rl, dict):
        return Rollout()  # the trainer's parser names a malformed section
    replicas = rl.get("rollout_replicas", 0) or 0
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ValueError(f"{path}: rl.rollout_replicas is {replicas!r}; expected an integer >= 0")
    servers = rl.get("rollout_servers") or []
    servers = [s.strip() for s in servers.split(",")] if isinstance(servers, str) else list(servers)
    if replicas and servers:
        raise ValueError(f"{path}: rl.rollout_replicas and rl.rollout_servers are both set; give the servers "
                         "started elsewhere, or the number of local replicas, not both")
    weights = rl.get("rollout_weights_dir")
    return Rollout(replicas, servers, str(rl.get("rollout_weight_transport", "filesystem")),
                   Path(weights) if weights else None)


def trainer_devices(devices: list[int] | None, rollout: Rollout) -> list[int] | None:
    """The GPUs the trainer's ranks get: the job's devices after the replicas' (None: every GPU)."""
    return devices if devices is None else devices[rollout.replicas:]


def rollout_exports(rollout: Rollout, no_weights: Path) -> dict[str, str]:
    """What compose (`compose.rollout.yaml`) and the entrypoint read."""
    shared = rollout.external and rollout.transport == "filesystem" and rollout.weights_dir is not None
    return {"ASTRAI_ROLLOUT_REPLICAS": str(rollout.replicas),
            "ASTRAI_ROLLOUT_SERVERS": ",".join(rollout.servers),
            # mounted at its own path in the container; a job without one mounts an empty directory
            "ASTRAI_ROLLOUT_WEIGHTS_DIR": str(rollout.weights_dir if shared else no_weights)}


def rollout_problems(rollout: Rollout, devices: list[int] | None, gpus: int | None) -> list[str]:
    """What would make a job with rollout servers fail, each with its fix."""
    problems = []
    have = len(devices) if devices is not None else gpus
    if rollout.replicas and have is not None and have <= rollout.replicas:
        problems.append(f"rollout: rl.rollout_replicas {rollout.replicas} needs {rollout.replicas + 1} GPUs or more "
                        f"(one per replica, then the trainer's) but the job has {have}; add infra.devices or lower "
                        "rl.rollout_replicas")
    if rollout.external and rollout.transport == "filesystem":
        if rollout.weights_dir is None or not rollout.weights_dir.is_absolute():
            problems.append("rollout: rl.rollout_servers with the filesystem transport needs rl.rollout_weights_dir, "
                            "an absolute path on storage the servers' node mounts at the same path (or set "
                            "rl.rollout_weight_transport: broadcast)")
        elif not rollout.weights_dir.is_dir():
            problems.append(f"rollout: rl.rollout_weights_dir {rollout.weights_dir} is not a directory on this node; "
                            "mount the shared storage the servers load from there")
    return problems
