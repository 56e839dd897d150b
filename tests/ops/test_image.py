"""docker/compose.yaml, docker/Dockerfile and .dockerignore, read as data (no Docker engine needed)."""

from __future__ import annotations

import re

import yaml

from tests.ops.fakes import REPO

COMPOSE = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
ROLLOUT = yaml.safe_load((REPO / "docker" / "compose.rollout.yaml").read_text())["services"]


def mounts(service: dict) -> dict[str, dict]:
    return {v["target"]: v for v in service["volumes"]}


def test_every_service_pins_the_image_and_never_builds_or_pulls():
    assert set(SERVICES) == {"train", "server", "server-cpu"}
    for name, s in SERVICES.items():
        assert s["image"] == "astrai:latest", name
        assert "build" not in s and s["pull_policy"] == "never", name
        assert s["user"] == "${ASTRAI_UID:-1000}:${ASTRAI_GID:-1000}", name
        assert s["init"] is True, name
        assert s["logging"]["driver"] == "json-file" and s["logging"]["options"]["max-size"], name


def test_profiles():
    assert {name: s["profiles"] for name, s in SERVICES.items()} == {
        "train": ["train"], "server": ["server"], "server-cpu": ["server-cpu"]}


def test_train_service():
    t = SERVICES["train"]
    assert t["command"] == ["astrai-entrypoint"]
    assert t["ipc"] == "host" and t["restart"] == "no" and t["stop_signal"] == "SIGTERM"
    assert t["stop_grace_period"] == "${ASTRAI_STOP_TIMEOUT:-600}s"
    (gpus,) = t["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}  # filtering: CUDA_VISIBLE_DEVICES only
    m = mounts(t)
    assert set(m) == {"/data", "/model", "/checkpoints"}
    assert m["/data"]["read_only"] and m["/model"]["read_only"] and not m["/checkpoints"].get("read_only", False)
    assert m["/data"]["source"].startswith("${ASTRAI_DATA_DIR")
    assert m["/model"]["source"].startswith("${ASTRAI_MODEL_DIR")
    assert m["/checkpoints"]["source"].startswith("${ASTRAI_CHECKPOINT_DIR")
    assert all(v["bind"]["create_host_path"] is False for v in m.values())  # a typo never makes an empty dir
    env = t["environment"]
    assert "CUDA_VISIBLE_DEVICES" in env  # passed through only when set (unset = every GPU)
    assert {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME"} <= set(env)
    assert {"ASTRAI_GPU_COUNT", "ASTRAI_PARALLEL_MODE", "ASTRAI_STOP_TIMEOUT", "ASTRAI_MAX_DURATION_SECONDS"} <= set(env)
    (env_file,) = t["env_file"]
    assert env_file["path"].startswith("${ASTRAI_JOB_ENV_FILE") and env_file["required"] is False


def test_server_services():
    gpu, cpu = SERVICES["server"], SERVICES["server-cpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert "deploy" not in cpu
    for s in (gpu, cpu):
        assert s["command"][:4] == ["astrai", "serve", "--model", "/model"]
        assert s["ports"] == ["${ASTRAI_PORT:-8000}:8000"]
        assert mounts(s)["/model"]["read_only"]
        assert "ASTRAI_API_KEY" in s["environment"]
    assert cpu["command"][-2:] == ["--device", "cpu"]


def test_the_rollout_layout_joins_the_host_network_and_pins_the_image():
    server, train = ROLLOUT["rollout-server"], ROLLOUT["train"]
    assert server["image"] == "astrai:latest" and server["pull_policy"] == "never" and "build" not in server
    assert server["profiles"] == ["rollout-server"] and "profiles" not in train  # train keeps compose.yaml's
    assert server["network_mode"] == train["network_mode"] == "host"  # the broadcast group connects back
    assert server["command"][:4] == ["astrai", "serve", "--model", "/model"] and "--weights_dir" in server["command"]
    assert {"ASTRAI_ADMIN_KEY", "ASTRAI_API_KEY"} <= set(server["environment"]) & set(train["environment"])
    weights = "${ASTRAI_ROLLOUT_WEIGHTS_DIR:-/unset-ASTRAI_ROLLOUT_WEIGHTS_DIR}"
    for s in (server, train):  # the shared storage at the same path on both nodes
        assert weights in [v["target"] for v in s["volumes"]]
        assert all(v["bind"]["create_host_path"] is False for v in s["volumes"])


def test_the_compose_variables_are_the_ones_the_scripts_export():
    """Every ${ASTRAI_*} compose reads is exported by the ops helper or the scripts."""
    used = set(re.findall(r"\$\{(ASTRAI_\w+)", (REPO / "docker" / "compose.yaml").read_text()
                                                + (REPO / "docker" / "compose.rollout.yaml").read_text()))
    exported = set(re.findall(r'"(ASTRAI_\w+)"', (REPO / "src" / "astrai" / "ops.py").read_text()
                                                   + (REPO / "src" / "astrai" / "ops_rollout.py").read_text()))
    scripts = "".join(p.read_text() for p in (REPO / "scripts").glob("*.sh"))
    exported |= set(re.findall(r"(ASTRAI_\w+)=", scripts))
    assert used - exported == set()


def test_dockerfile_build_args_user_and_entrypoint():
    text = (REPO / "docker" / "Dockerfile").read_text()
    args = set(re.findall(r"^ARG (\w+)", text, re.M))
    assert {"TORCH_VARIANT", "TORCH_VERSION", "USER_UID", "USER_GID"} <= args
    assert "ARG TORCH_VERSION=2.13.0" in text  # the pinned torch, as `make setup`
    assert re.search(r"download.pytorch.org/whl/\$\{TORCH_VARIANT\}", text)
    assert re.search(r"useradd --uid \"\$\{USER_UID\}\" --gid \"\$\{USER_GID\}\"", text)
    assert re.search(r"^USER astrai$", text, re.M)
    assert "COPY docker/entrypoint.sh /usr/local/bin/astrai-entrypoint" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", ".env*"} <= set(ignored)
    assert not {"src", "pyproject.toml", "docker"} & set(ignored)  # what the image copies
