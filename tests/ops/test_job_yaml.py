"""The job YAML helper (`python -m astrai.ops`): infra keys, fallbacks, devices, derived trainer config, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from astrai import ops
from astrai.config import build_config, load_config
from tests.ops.fakes import base_env, write_job


def exports(job: ops.Job) -> dict[str, str | None]:
    """name -> value of the export lines; None for an unset."""
    out: dict[str, str | None] = {}
    for line in ops.shell_exports(job).splitlines():
        word, _, rest = line.partition(" ")
        name, _, value = rest.partition("=")
        out[name] = None if word == "unset" else yaml.safe_load(value) if value != "''" else ""
    return out


def test_devices_all_leaves_cuda_visible_devices_unset(tmp_path):
    job = ops.load_job(write_job(tmp_path), env={"CUDA_VISIBLE_DEVICES": "3"})
    env = exports(job)
    assert env["CUDA_VISIBLE_DEVICES"] is None  # `unset`, never an empty string
    assert env["ASTRAI_DEVICES"] == "all" and env["ASTRAI_GPU_COUNT"] == "all"
    assert env["ASTRAI_PARALLEL_MODE"] == "auto"  # decided in the container, where the GPUs are counted
    assert env["ASTRAI_STOP_TIMEOUT"] == 600 and env["ASTRAI_KEEP_LAST"] == 3
    assert env["ASTRAI_DATA_DIR"] == str((tmp_path / "data").resolve())  # relative to the job file
    assert env["ASTRAI_CHECKPOINT_DIR"] == str((tmp_path / "checkpoints").resolve())
    assert env["ASTRAI_PROJECT"] == "astrai-demo"


@pytest.mark.parametrize(("devices", "visible", "count", "mode"), [
    ([0, 1], "0,1", 2, "ddp"), ([3], 3, 1, "none"), ("1,2", "1,2", 2, "ddp"), (2, 2, 1, "none"),
])
def test_a_device_list_exports_ids_count_and_auto_mode(tmp_path, devices, visible, count, mode):
    job = ops.load_job(write_job(tmp_path, {"devices": devices}), env={})
    env = exports(job)
    assert env["CUDA_VISIBLE_DEVICES"] == visible and env["ASTRAI_GPU_COUNT"] == count
    assert env["ASTRAI_PARALLEL_MODE"] == mode


@pytest.mark.parametrize(("devices", "match"), [
    ([0, 0], "GPU 0 more than once"), ("0,1,1", "GPU 1 more than once"), (["a"], "'a'"),
    ([-1], "-1"), ("gpu0", "'gpu0'"), ([], "empty"), ([True], "True"), ([1.5], "1.5"),
])
def test_bad_devices_are_errors_naming_the_key(tmp_path, devices, match):
    path = write_job(tmp_path, {"devices": devices})
    with pytest.raises(ops.OpsError, match=match) as e:
        ops.load_job(path, env={})
    assert str(path) in str(e.value) and "infra.devices" in str(e.value)


def test_infra_overrides_host_variables_and_absent_keys_fall_back(tmp_path):
    host = {"ASTRAI_DEVICES": "1", "ASTRAI_STOP_TIMEOUT": "120", "ASTRAI_KEEP_LAST": "7",
            "ASTRAI_MAX_DURATION_HOURS": "0.5", "ASTRAI_CHECKPOINT_DIR": "elsewhere"}
    job = ops.load_job(write_job(tmp_path, {"devices": [0, 1], "keep_last": 2}), env=host)
    assert job.devices == [0, 1] and job.keep_last == 2  # from infra:
    assert job.stop_timeout_seconds == 120 and job.max_duration_hours == 0.5  # from the host
    assert job.checkpoint_dir == (tmp_path / "elsewhere").resolve()  # relative to the job file too
    assert exports(job)["ASTRAI_MAX_DURATION_SECONDS"] == 1800


@pytest.mark.parametrize(("infra", "match"), [
    ({"job_name": "-bad"}, r"infra.job_name '-bad' must match"),
    ({"job_name": "a b"}, "infra.job_name"),
    ({"data_dir": None}, "infra.data_dir is missing"),
    ({"parallel_mode": "tp"}, "infra.parallel_mode is 'tp'"),
    ({"stop_timeout_seconds": "soon"}, "infra.stop_timeout_seconds"),
    ({"keep_last": 0}, "infra.keep_last is 0"),
    ({"max_duration_hours": -1}, "infra.max_duration_hours"),
    ({"environment": ["A=1"]}, "infra.environment must be a mapping"),
    ({"environment": {"A B": 1}}, "infra.environment.A B"),
    ({"gpus": 2}, "unknown key infra.gpus"),
])
def test_bad_infra_values_name_the_file_and_key(tmp_path, infra, match):
    path = write_job(tmp_path, infra)
    with pytest.raises(ops.OpsError, match=match) as e:
        ops.load_job(path, env={})
    assert str(path) in str(e.value)


def test_bad_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("infra:\n  data_dir: data\n  devices: [0, 1\n")
    with pytest.raises(ops.OpsError, match=r"train.yaml:4:1: not valid YAML: expected ',' or ']'") as e:
        ops.load_job(path, env={})
    assert str(path) in str(e.value)
    path.write_text("- a list\n")
    with pytest.raises(ops.OpsError, match="expected a mapping of sections"):
        ops.load_job(path, env={})
    with pytest.raises(ops.OpsError, match="job file not found"):
        ops.load_job(tmp_path / "missing.yaml", env={})


def test_prepare_writes_the_trainer_sections_without_infra(tmp_path):
    job = ops.load_job(write_job(tmp_path, {"environment": {"NCCL_DEBUG": "WARN", "HF_TOKEN": "x"}}), env={})
    out = ops.prepare(job, ["--max_lr", "3e-4"], env={"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "HOME": "/h"})
    assert out == tmp_path.resolve() / "checkpoints" / "job"
    derived = yaml.safe_load((out / "trainer.yaml").read_text())
    assert "infra" not in derived
    assert derived["ckpt"] == {"ckpt_dir": "/checkpoints", "keep_last": 3}
    assert derived["log"] == {"log_dir": "/checkpoints/log"}
    assert derived["train"] == {"max_steps": 10}
    cfg = load_config(out / "trainer.yaml", ["--max_lr", "3e-4"])  # the trainer's own loader accepts it
    assert cfg.train.max_steps == 10 and cfg.ckpt.ckpt_dir == "/checkpoints" and cfg.optim.max_lr == 3e-4
    # host NCCL_* forwarded, infra.environment on top; nothing else of the host leaks in
    assert (out / "container.env").read_text().splitlines() == ["NCCL_DEBUG=WARN", "NCCL_IB_DISABLE=1", "HF_TOKEN=x"]
    assert (out / "args").read_text().splitlines() == ["--max_lr", "3e-4"]
    assert (out / "no-model").is_dir()


@pytest.mark.parametrize(("trainer", "args", "match"), [
    ({"ckpt": {"ckpt_dir": "out"}}, [], "ckpt_dir is set by the container; set infra.checkpoint_dir"),
    ({"dist": {"nprocs": 2}}, [], "nprocs is set by the container"),
    ({"train": {"param_path": "m"}}, [], "param_path is set by the container"),
    ({}, ["--resume"], "resume is set by the container"),
    ({}, ["--max_lrr", "1"], "unknown flag --max_lrr; did you mean 'max_lr'"),
    ({"train": {"max_step": 3}}, [], "unknown config key 'max_step' in section 'train'"),
    ({"model": {"hidden_size": 32}}, [], "model: section .* infra.model_dir"),
])
def test_prepare_refuses_what_the_container_decides_and_what_the_trainer_rejects(tmp_path, trainer, args, match):
    job = ops.load_job(write_job(tmp_path, trainer={"data": {"train_type": "sft"}, **trainer}), env={})
    with pytest.raises(ops.OpsError, match=match):
        ops.prepare(job, args, env={})
    assert not (tmp_path / "checkpoints" / "job" / "trainer.yaml").exists()


def test_a_model_section_job_needs_no_model_dir(tmp_path):
    from tests.train.resume_data import MODEL

    path = write_job(tmp_path, {"model_dir": None}, trainer={"model": MODEL, "data": {"train_type": "seq"}})
    job = ops.load_job(path, env={})
    assert job.model_dir is None
    assert exports(job)["ASTRAI_MODEL_DIR"] == str(tmp_path.resolve() / "checkpoints" / "job" / "no-model")
    derived = yaml.safe_load((ops.prepare(job, [], env={}) / "trainer.yaml").read_text())
    assert build_config(derived, {}).model["hidden_size"] == MODEL["hidden_size"]
    job = ops.load_job(write_job(tmp_path, {"model_dir": None}), env={})
    with pytest.raises(ops.OpsError, match="infra.model_dir is missing"):
        ops.prepare(job, [], env={})


def test_init_writes_a_template_that_loads_and_never_overwrites(tmp_path, capsys):
    path = tmp_path / "jobs" / "sft-7b.yaml"
    assert ops.main(["init", str(path)]) == 0
    job = ops.load_job(path, env={})
    assert job.job_name == "sft-7b" and job.devices is None and job.stop_timeout_seconds == 600
    assert ops.main(["init", str(path)]) == 1
    assert "already exists" in capsys.readouterr().err


def test_missing_pyyaml_fails_fast_with_the_fix(tmp_path):
    shadow = tmp_path / "shadow" / "yaml"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named yaml')\n")
    env = base_env(tmp_path)
    env["PYTHONPATH"] = f"{shadow.parent}:{env['PYTHONPATH']}"
    r = subprocess.run([sys.executable, "-m", "astrai.ops", "env", str(write_job(tmp_path))], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "PyYAML is not installed" in r.stderr and "pip install pyyaml" in r.stderr


def test_clean_keeps_the_newest_and_previews_without_force(tmp_path, capsys):
    from astrai.train.publish import publish

    job = ops.load_job(write_job(tmp_path), env={})
    for step in (1, 2, 3, 4):
        publish(job.checkpoint_dir, step, lambda d: (d / "model.safetensors").write_bytes(b"w"))
    (job.checkpoint_dir / "step_00000005").mkdir()  # damaged (no manifest) and newest: left alone
    assert ops.main(["clean", str(job.path), "--keep", "2"]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and "preview only" in out and "keeping step_00000005" in out
    assert len(list(job.checkpoint_dir.glob("step_*"))) == 5
    assert ops.main(["clean", str(job.path), "--keep", "2", "--force"]) == 0
    assert sorted(p.name for p in job.checkpoint_dir.glob("step_*")) == ["step_00000003", "step_00000004",
                                                                         "step_00000005"]


def _rl_job(tmp_path, rl: dict, infra: dict | None = None) -> ops.Job:
    trainer = {"data": {"train_type": "online_grpo", "data_path": "/data/prompts.jsonl"},
               "train": {"max_steps": 10}, "rl": {"rewards": ["exact_match"], **rl}}
    return ops.load_job(write_job(tmp_path, infra, trainer), env={})


def test_rollout_servers_place_replicas_first_and_check_what_the_layout_needs(tmp_path):
    job = _rl_job(tmp_path, {"rollout_replicas": 1}, {"devices": [0, 1, 2]})
    env = exports(job)
    assert env["ASTRAI_ROLLOUT_REPLICAS"] == 1 and env["ASTRAI_GPU_COUNT"] == 3  # the entrypoint subtracts
    assert env["ASTRAI_PARALLEL_MODE"] == "ddp" and env["ASTRAI_ROLLOUT_SERVERS"] == ""  # two trainer ranks
    assert env["ASTRAI_ROLLOUT_WEIGHTS_DIR"] == str(job.job_dir / "no-weights")
    assert exports(_rl_job(tmp_path, {"rollout_replicas": 1}, {"devices": [0, 1]}))["ASTRAI_PARALLEL_MODE"] == "none"
    too_many = _rl_job(tmp_path, {"rollout_replicas": 2}, {"devices": [0, 1]})
    assert any("rl.rollout_replicas 2 needs 3 GPUs or more" in p for p in ops.preflight(too_many))
    remote = _rl_job(tmp_path, {"rollout_servers": ["http://node-a:8100"]})
    assert any("needs rl.rollout_weights_dir" in p for p in ops.preflight(remote))  # filesystem transport
    broadcast = _rl_job(tmp_path, {"rollout_servers": ["http://node-a:8100"], "rollout_weight_transport": "broadcast"})
    assert exports(broadcast)["ASTRAI_ROLLOUT_SERVERS"] == "http://node-a:8100"
    assert not any(p.startswith("rollout:") for p in ops.preflight(broadcast))
    with pytest.raises(ops.OpsError, match="rollout_replicas and rl.rollout_servers are both set"):
        _rl_job(tmp_path, {"rollout_servers": ["http://node-a:8100"], "rollout_replicas": 1})
