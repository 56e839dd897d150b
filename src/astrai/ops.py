"""Host side of the operator scripts: one job YAML (`train.yaml`) -> shell environment, container files, checks.

`scripts/train.sh` never parses YAML itself; it calls this module. A job file holds the trainer's
own sections (model, data, train, optim, objective, ckpt, log) plus an `infra:` section that
says where the job runs (directories, GPUs, timeouts). The trainer rejects unknown sections, so
`prepare` writes the trainer sections alone, with the container's paths filled in, to
`<checkpoint_dir>/job/trainer.yaml`; the container's entrypoint runs `astrai train` on that file.

    python -m astrai.ops env JOB.yaml                 `export`/`unset` lines for the shell to eval
    python -m astrai.ops prepare JOB.yaml [-- ARGS]   write <checkpoint_dir>/job/ (trainer.yaml, container.env, args)
    python -m astrai.ops preflight JOB.yaml           Docker daemon, directories, base model, GPUs
    python -m astrai.ops clean JOB.yaml [--keep N] [--force]
    python -m astrai.ops init JOB.yaml                write a commented template

An `infra:` key that is absent falls back to its host variable (`ASTRAI_DEVICES`, ... usually
set by `.env.train`), then to its default. Every error names the file and the key. A job whose
`rl:` section draws rollouts from servers (local replicas on its first GPUs, or servers on another
node) is placed by `ops_rollout.py`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.flags import ArgumentParser
from astrai.ops_rollout import Rollout, read_rollout, rollout_exports, rollout_problems, trainer_devices

try:
    import yaml
except ImportError:  # reported by main() with the fix, before anything else runs
    yaml = None

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")
# where compose mounts the job's directories inside the container
CKPT_MOUNT, MODEL_MOUNT, DATA_MOUNT = "/checkpoints", "/model", "/data"
# infra key -> (host variable it falls back to, default)
INFRA: dict[str, tuple[str | None, Any]] = {
    "job_name": ("ASTRAI_JOB_NAME", None),  # default: the job file's name without .yaml
    "data_dir": ("ASTRAI_DATA_DIR", None),
    "model_dir": ("ASTRAI_MODEL_DIR", None),
    "checkpoint_dir": ("ASTRAI_CHECKPOINT_DIR", "checkpoints"),
    "devices": ("ASTRAI_DEVICES", "all"),
    "parallel_mode": ("ASTRAI_PARALLEL_MODE", "auto"),
    "stop_timeout_seconds": ("ASTRAI_STOP_TIMEOUT", 600),
    "keep_last": ("ASTRAI_KEEP_LAST", 3),
    "max_duration_hours": ("ASTRAI_MAX_DURATION_HOURS", None),
    "environment": (None, {}),
}
# trainer keys the container decides; a job file that sets them is refused
CONTAINER_KEYS = {
    "ckpt_dir": "infra.checkpoint_dir", "log_dir": "infra.checkpoint_dir (logs go to its log/)",
    "param_path": "infra.model_dir (the entrypoint resumes from the newest checkpoint)",
    "resume": "the entrypoint (it resumes whenever a complete checkpoint exists)",
    "nprocs": "infra.devices (one rank per GPU)", "parallel_mode": "infra.parallel_mode",
    "stop_timeout": "infra.stop_timeout_seconds", "keep_last": "infra.keep_last",
}


class OpsError(ValueError):
    """A bad job file or environment; the message names the file, the key and the fix."""


@dataclass
class Job:
    path: Path
    job_name: str
    data_dir: Path
    model_dir: Path | None
    checkpoint_dir: Path
    devices: list[int] | None  # None: every GPU (CUDA_VISIBLE_DEVICES stays unset)
    parallel_mode: str
    stop_timeout_seconds: int
    keep_last: int | None
    max_duration_hours: float | None
    environment: dict[str, str] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)  # the trainer's sections, infra removed
    rollout: Rollout = field(default_factory=Rollout)  # rl.rollout_replicas / rollout_servers (ops_rollout.py)

    @property
    def job_dir(self) -> Path:
        """Files the container reads, written by `prepare`."""
        return self.checkpoint_dir / "job"

    @property
    def resolved_parallel_mode(self) -> str:
        if self.parallel_mode != "auto" or self.devices is None:
            return self.parallel_mode  # with `all` the entrypoint counts the GPUs it sees
        return "ddp" if len(trainer_devices(self.devices, self.rollout) or []) > 1 else "none"


# ----------------------------------------------------------------------------- reading


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise OpsError(f"{path}: job file not found; create one with `scripts/train.sh init`")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise OpsError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise OpsError(f"{path}: expected a mapping of sections (infra:, data:, train:, ...), got {type(data).__name__}")
    return data


def _int(path: Path, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise OpsError(f"{path}: infra.{key} is {value!r}; expected an integer >= {minimum}")
    return value


def parse_devices(path: Path, value: Any) -> list[int] | None:
    """`all` -> None; a list (or "0,1", or one id) of distinct GPU ids -> the ids."""
    if isinstance(value, str) and value.strip() == "all":
        return None
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    ids = []
    for item in items:
        text = str(item).strip() if not isinstance(item, bool) else "bool"
        if not text.isdigit():
            raise OpsError(f"{path}: infra.devices has {item!r}; expected `all` or a list of GPU ids like [0, 1]")
        ids.append(int(text))
    if not ids:
        raise OpsError(f"{path}: infra.devices is empty; give `all` or a list of GPU ids like [0, 1]")
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise OpsError(f"{path}: infra.devices lists GPU {dup[0]} more than once: {ids}")
    return ids


def _infra_value(path: Path, infra: dict[str, Any], key: str, env: dict[str, str]) -> Any:
    var, default = INFRA[key]
    if key in infra and infra[key] is not None:
        return infra[key]
    if var and env.get(var, "") != "":
        return env[var]
    return default


def _dir(path: Path, key: str, value: Any) -> Path:
    if not isinstance(value, str | os.PathLike) or str(value) == "":
        raise OpsError(f"{path}: infra.{key} is {value!r}; expected a directory path")
    p = Path(os.path.expanduser(str(value)))
    return (p if p.is_absolute() else path.parent / p).resolve()


def load_job(path: str | Path, env: dict[str, str] | None = None) -> Job:
    """The job file, infra keys checked and completed from `env` (default: os.environ)."""
    path = Path(path).resolve()
    env = dict(os.environ if env is None else env)
    data = read_yaml(path)
    infra = data.pop("infra", None) or {}
    if not isinstance(infra, dict):
        raise OpsError(f"{path}: infra must be a mapping, got {infra!r}")
    unknown = sorted(set(infra) - set(INFRA))
    if unknown:
        raise OpsError(f"{path}: unknown key infra.{unknown[0]}; infra keys are {', '.join(INFRA)}")
    get = lambda key: _infra_value(path, infra, key, env)  # noqa: E731

    name = get("job_name") or path.stem
    if not isinstance(name, str) or not JOB_NAME.match(name):
        raise OpsError(f"{path}: infra.job_name {name!r} must match {JOB_NAME.pattern} (letters, digits, . _ -)")
    if get("data_dir") is None:
        raise OpsError(f"{path}: infra.data_dir is missing; the directory mounted read-only at {DATA_MOUNT}")
    mode = get("parallel_mode")
    if mode not in PARALLEL_MODES:
        raise OpsError(f"{path}: infra.parallel_mode is {mode!r}; expected one of {', '.join(PARALLEL_MODES)}")
    keep = get("keep_last")
    hours = get("max_duration_hours")
    if hours is not None:
        try:
            hours = float(hours)
        except (TypeError, ValueError):
            hours = -1.0
        if not hours > 0:
            raise OpsError(f"{path}: infra.max_duration_hours is {get('max_duration_hours')!r}; expected hours > 0")
    environment = get("environment")
    if not isinstance(environment, dict):
        raise OpsError(f"{path}: infra.environment must be a mapping of NAME: value, got {environment!r}")
    for k, v in environment.items():
        if not isinstance(k, str) or not ENV_NAME.match(k) or isinstance(v, dict | list) or "\n" in str(v):
            raise OpsError(f"{path}: infra.environment.{k}: expected a variable name and a one-line value")
    model_dir = get("model_dir")
    try:
        rollout = read_rollout(path, data)
    except ValueError as e:
        raise OpsError(str(e)) from None
    return Job(
        path=path, job_name=name, data_dir=_dir(path, "data_dir", get("data_dir")),
        model_dir=_dir(path, "model_dir", model_dir) if model_dir is not None else None,
        checkpoint_dir=_dir(path, "checkpoint_dir", get("checkpoint_dir")),
        devices=parse_devices(path, get("devices")), parallel_mode=mode,
        stop_timeout_seconds=_int(path, "stop_timeout_seconds", get("stop_timeout_seconds"), 1),
        keep_last=None if keep is None else _int(path, "keep_last", keep, 1), max_duration_hours=hours,
        environment={k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                     for k, v in environment.items()},
        trainer=data, rollout=rollout,
    )


# ----------------------------------------------------------------------------- outputs


def shell_exports(job: Job) -> str:
    """What `scripts/train.sh` evals: every ASTRAI_* variable compose and the entrypoint read."""
    values = {
        "ASTRAI_JOB_FILE": str(job.path),
        "ASTRAI_JOB_NAME": job.job_name,
        "ASTRAI_PROJECT": "astrai-" + re.sub(r"[^a-z0-9_-]", "-", job.job_name.lower()),
        "ASTRAI_DATA_DIR": str(job.data_dir),
        # a job that builds its model from a `model:` section mounts an empty directory instead
        "ASTRAI_MODEL_DIR": str(job.model_dir or job.job_dir / "no-model"),
        "ASTRAI_CHECKPOINT_DIR": str(job.checkpoint_dir),
        "ASTRAI_JOB_ENV_FILE": str(job.job_dir / "container.env"),
        "ASTRAI_DEVICES": "all" if job.devices is None else ",".join(map(str, job.devices)),
        "ASTRAI_GPU_COUNT": "all" if job.devices is None else str(len(job.devices)),
        "ASTRAI_PARALLEL_MODE": job.resolved_parallel_mode,
        "ASTRAI_STOP_TIMEOUT": str(job.stop_timeout_seconds),
        "ASTRAI_KEEP_LAST": "" if job.keep_last is None else str(job.keep_last),
        "ASTRAI_MAX_DURATION_SECONDS": "" if job.max_duration_hours is None
        else str(max(1, round(job.max_duration_hours * 3600))),
        **rollout_exports(job.rollout, job.job_dir / "no-weights"),
    }
    lines = [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
    if job.devices is None:
        lines.append("unset CUDA_VISIBLE_DEVICES")  # an empty value would hide every GPU
    else:
        lines.append(f"export CUDA_VISIBLE_DEVICES={values['ASTRAI_DEVICES']}")
    return "\n".join(lines) + "\n"


def _given_keys(trainer: dict[str, Any]) -> set[str]:
    keys = set()
    for key, content in trainer.items():
        keys |= set(content) if isinstance(content, dict) and key != "model" else {key}
    return keys


def trainer_config(job: Job, args: list[str]) -> dict[str, Any]:
    """The trainer's sections with the container's paths; checked by the trainer's own parser."""
    from astrai.config import ConfigError, build_config, parse_overrides

    where = f"{job.path}"
    try:
        overrides = parse_overrides(args)
    except ConfigError as e:
        raise OpsError(f"{where}: trainer arguments {args}: {e}") from None
    for key in sorted((_given_keys(job.trainer) | set(overrides)) & set(CONTAINER_KEYS)):
        raise OpsError(f"{where}: {key} is set by the container; set {CONTAINER_KEYS[key]} instead")
    if job.trainer.get("model") and job.model_dir is not None:
        raise OpsError(f"{where}: a model: section builds a new model and infra.model_dir names a base model; keep one")
    if not job.trainer.get("model") and job.model_dir is None:
        raise OpsError(f"{where}: infra.model_dir is missing; name the base model, or add a model: section to "
                       "train a new one")
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in job.trainer.items()}
    out.setdefault("ckpt", {}).update({"ckpt_dir": CKPT_MOUNT, "keep_last": job.keep_last})
    out.setdefault("log", {})["log_dir"] = f"{CKPT_MOUNT}/log"
    try:
        build_config(out, overrides)
    except ConfigError as e:
        raise OpsError(f"{where}: {e}") from None
    return out


def container_env(job: Job, env: dict[str, str]) -> str:
    """env_file lines for the container: the host's NCCL_* variables, then infra.environment on top."""
    values = {k: v for k, v in sorted(env.items()) if k.startswith("NCCL_") and "\n" not in v}
    values.update(job.environment)
    return "".join(f"{k}={v}\n" for k, v in values.items())


def prepare(job: Job, args: list[str], env: dict[str, str]) -> Path:
    """Write <checkpoint_dir>/job/: trainer.yaml, container.env, args (one trainer flag a line)."""
    if any("\n" in a for a in args):
        raise OpsError(f"{job.path}: trainer arguments may not contain newlines: {args}")
    text = yaml.safe_dump(trainer_config(job, args), sort_keys=False)
    job.job_dir.mkdir(parents=True, exist_ok=True)
    (job.job_dir / "no-model").mkdir(exist_ok=True)
    (job.job_dir / "no-weights").mkdir(exist_ok=True)
    for name, content in [("trainer.yaml", f"# written by `python -m astrai.ops prepare {job.path.name}`; edit "
                           f"{job.path.name} instead\n" + text), ("container.env", container_env(job, env)),
                          ("args", "".join(a + "\n" for a in args))]:
        tmp = job.job_dir / f".{name}.tmp"
        tmp.write_text(content)
        os.replace(tmp, job.job_dir / name)
    return job.job_dir


# ----------------------------------------------------------------------------- checks


def count_gpus() -> int | None:
    """GPUs the host driver lists (`nvidia-smi -L`), or None without a driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in r.stdout.splitlines()) if r.returncode == 0 else None


def preflight(job: Job, args: list[str] | None = None) -> list[str]:
    """Every problem that would make `start` fail, each with its fix; empty when ready."""
    problems = []
    if shutil.which("docker") is None:
        problems.append("docker: the docker command is not installed")
    else:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
        if r.returncode != 0:
            reason = (r.stderr.strip().splitlines() or ["no answer"])[-1]
            problems.append(f"docker: the Docker daemon is not reachable ({reason}); start it, or check "
                            "DOCKER_HOST and that your user may use docker")
    if not job.data_dir.is_dir():
        problems.append(f"data_dir: {job.data_dir} is not a directory (infra.data_dir in {job.path})")
    try:
        job.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        probe = job.checkpoint_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        problems.append(f"checkpoint_dir: {job.checkpoint_dir} is not writable ({e.strerror}); fix its owner "
                        "or permissions, or point infra.checkpoint_dir elsewhere")
    has_ckpt = job.checkpoint_dir.is_dir() and any(job.checkpoint_dir.glob("step_*"))
    if not has_ckpt and job.model_dir is not None and not (job.model_dir / "config.json").is_file():
        problems.append(f"model_dir: there is no checkpoint yet and {job.model_dir} holds no config.json; "
                        "point infra.model_dir at a model directory")
    gpus = count_gpus()
    if gpus is None or gpus == 0:
        problems.append("devices: no GPU found (nvidia-smi is missing or lists none); the train service reserves "
                        "GPUs, so install the NVIDIA driver and container toolkit")
    elif job.devices is not None and max(job.devices) >= gpus:
        problems.append(f"devices: infra.devices is {job.devices} but this host has {gpus} GPU(s) "
                        f"(ids 0..{gpus - 1})")
    problems += rollout_problems(job.rollout, job.devices, gpus)
    try:
        trainer_config(job, args or [])
    except OpsError as e:
        problems.append(f"config: {e}")
    return problems


# ----------------------------------------------------------------------------- clean, init


def clean(job: Job, keep: int, force: bool) -> list[Path]:
    """Remove complete checkpoints older than the newest `keep`, and damaged ones older than those."""
    from astrai.train.publish import STEP_DIR, list_checkpoints

    complete = [p for _, p in list_checkpoints(job.checkpoint_dir)]
    kept = complete[-keep:] if keep > 0 else []
    oldest_kept = kept[0].name if kept else None
    doomed = []
    for p in sorted(job.checkpoint_dir.iterdir()) if job.checkpoint_dir.is_dir() else []:
        if not (p.is_dir() and STEP_DIR.match(p.name)) or p in kept:
            continue
        if p in complete or (oldest_kept is not None and p.name < oldest_kept):
            doomed.append(p)
        else:
            print(f"keeping {p.name}: damaged and newer than every kept checkpoint; inspect it with "
                  f"`astrai ckpt verify {p}`")
    for p in doomed:
        if force:
            shutil.rmtree(p)
        print(f"{'removed' if force else 'would remove'} {p}")
    if not force and doomed:
        print("preview only: run again with --force to remove")
    print(f"kept: {', '.join(p.name for p in kept) or 'nothing'}")
    return doomed


TEMPLATE = """\
# One training job: the trainer's sections (docs/training.md) plus infra: (docs/operations.md).
# Inside the container data_dir is /data, model_dir is /model, checkpoint_dir is /checkpoints.
infra:
  job_name: {name}
  data_dir: data              # relative to this file; mounted read-only
  model_dir: base-model       # the base model (read-only); used until a checkpoint exists
  checkpoint_dir: checkpoints # read-write: step_*/, log/, job/
  devices: all                # or a list of GPU ids: [0, 1]
  parallel_mode: auto         # auto (ddp for more than one GPU) | none | ddp | fsdp
  stop_timeout_seconds: 600
  keep_last: 3
  max_duration_hours: null
  environment: {{}}
data:
  train_type: sft
  data_path: /data/train.jsonl
  max_seq_len: 1024
train:
  n_epoch: 1
  batch_per_device: 8
  bf16: true
optim:
  max_lr: 2.0e-5
ckpt:
  ckpt_interval: 200
"""


def init(path: Path) -> None:
    if path.exists():
        raise OpsError(f"{path} already exists; edit it, or remove it first")
    name = path.stem if JOB_NAME.match(path.stem) else "job"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TEMPLATE.format(name=name))
    print(f"wrote {path}; edit infra.data_dir and infra.model_dir, then run `scripts/train.sh preflight`")


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if yaml is None:
        print(f"astrai.ops: PyYAML is not installed for {sys.executable}; run `make setup` or "
              "`pip install pyyaml`, or set ASTRAI_PYTHON to a Python that has it", file=sys.stderr)
        return 2
    args, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = ArgumentParser(prog="python -m astrai.ops", description="job YAML helper of scripts/*.sh")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("env", "prepare", "preflight", "init", "clean"):
        p = sub.add_parser(name)
        p.add_argument("job", type=Path)
        if name == "clean":
            p.add_argument("--keep", type=int, default=None, help="checkpoints to keep (default: infra.keep_last)")
            p.add_argument("--force", action="store_true", help="remove; without it, only show what would go")
    ns = parser.parse_args(args)
    try:
        if ns.command == "init":
            init(ns.job)
            return 0
        job = load_job(ns.job)
        if ns.command == "env":
            print(shell_exports(job), end="")
        elif ns.command == "prepare":
            print(prepare(job, extra, dict(os.environ)))
        elif ns.command == "preflight":
            problems = preflight(job, extra)
            for p in problems:
                print(f"preflight: {p}", file=sys.stderr)
            print("preflight: FAILED" if problems else "preflight: ok", file=sys.stderr if problems else sys.stdout)
            return 1 if problems else 0
        elif ns.command == "clean":
            keep = ns.keep if ns.keep is not None else (job.keep_last or 0)
            if keep < 0:
                raise OpsError(f"--keep {keep}: expected a number >= 0")
            clean(job, keep, ns.force)
    except OpsError as e:
        print(f"astrai.ops: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
