"""`astrai train` CLI: dry run, clear errors with non-zero exits, a tiny end-to-end run and resume, the
thread count set before the build (one by default on a CPU) and restored after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from astrai.train import signals
from astrai.train.cli import main


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    yield
    signals.uninstall_signal_handlers()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tokenizer trained on the fly and a small SFT JSONL file."""
    from astrai.data.tokenizer_training import train_tokenizer

    d = tmp_path_factory.mktemp("cli")
    rows = [{"messages": [{"role": "user", "content": f"add {i} and {i + 1}"},
                          {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}"}]} for i in range(24)]
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_tokenizer([d / "sft.jsonl"], vocab_size=300, out_dir=d / "tok")
    return d


def write_config(d, **train):
    cfg = {
        "model": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "max_position_embeddings": 128},
        "data": {"train_type": "sft", "data_path": str(d / "sft.jsonl"), "tokenizer_path": str(d / "tok"),
                 "max_seq_len": 64},
        "train": {"batch_per_device": 4, "max_steps": 2, **train},
        "optim": {"max_lr": 1.0e-3},
        "ckpt": {"ckpt_dir": str(d / "ckpt"), "ckpt_interval": 1, "keep_last": 2},
        "log": {"log_dir": str(d / "log"), "progress": False},
    }
    path = d / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dry_run_prints_resolved_config(workdir, capsys):
    path = write_config(workdir)
    assert main(["--config", str(path), "--max_lr", "5e-4", "--dry_run"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["optim"]["max_lr"] == pytest.approx(5e-4)  # flag over YAML
    assert out["train"]["batch_per_device"] == 4  # YAML over default
    assert out["optim"]["schedule"] == "cosine"  # default
    assert out["model"]["hidden_size"] == 32


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("train: [broken\n", [], "is not valid YAML"),
        ("train:\n  n_epcoh: 2\n", [], "unknown config key 'n_epcoh' in section 'train'; did you mean 'n_epoch'?"),
        ("train:\n  batch_per_device: 2.5\n", [], "'batch_per_device' in section 'train' has value 2.5"),
        ("{}\n", ["--lr", "0.1"], "unknown flag --lr"),
        ("{}\n", ["--train_type", "rlhf"], "is not one of"),
    ],
)
def test_bad_input_gives_clear_message_and_nonzero_exit(tmp_path, capsys, yaml_text, flags, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main(["--config", str(path), *flags]) != 0
    assert message in capsys.readouterr().err


def test_missing_config_and_data_files(workdir, tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.yaml")]) != 0
    assert "nope.yaml" in capsys.readouterr().err
    path = write_config(workdir)
    code = main(["--config", str(path), "--data_path", str(tmp_path / "missing.jsonl"),
                 "--log_dir", str(tmp_path / "log"), "--ckpt_dir", str(tmp_path / "ckpt")])
    assert code != 0
    err = capsys.readouterr().err
    assert "data_path" in err and "missing.jsonl" in err


def test_train_then_resume_continues(workdir):
    path = write_config(workdir)
    assert main(["--config", str(path)]) == 0
    ckpts = sorted(p.name for p in (workdir / "ckpt").iterdir() if not p.name.startswith("."))
    assert ckpts == ["step_00000001", "step_00000002"]
    assert main(["--config", str(path), "--resume", "--max_steps", "3"]) == 0
    lines = [json.loads(x) for x in (workdir / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]  # one log, continued
    state = json.loads((workdir / "ckpt" / "step_00000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["policy_version"] == 3


def test_param_path_loads_weights_only(workdir, tmp_path, capsys):
    path = write_config(workdir)
    # the module's ckpt_dir holds the runs of the tests before: a new run, on purpose
    assert main(["--config", str(path), "--max_steps", "1", "--overwrite_ckpt_dir"]) == 0
    ckpt = workdir / "ckpt" / "step_00000001"
    # a model section together with param_path is ambiguous
    assert main(["--config", str(path), "--param_path", str(ckpt), "--ckpt_dir", str(tmp_path / "amb")]) != 0
    assert "param_path" in capsys.readouterr().err.splitlines()[-1]
    cfg = yaml.safe_load(path.read_text())
    del cfg["model"]
    cfg["ckpt"]["ckpt_dir"], cfg["log"]["log_dir"] = str(tmp_path / "ckpt"), str(tmp_path / "log")
    path.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(path), "--param_path", str(ckpt), "--max_steps", "1"]) == 0
    state = json.loads((tmp_path / "ckpt" / "step_00000001" / "trainer_state.json").read_text())
    assert state["step"] == 1  # counted from 0 again: weights only, fresh optimizer and counters


EXAMPLES = {"pretrain": "seq", "sft": "sft", "dpo": "dpo", "reward_model": "reward", "ppo_reward_model": "online_ppo",
            "online_distill": "online_distill", "kd": "kd"}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_configs_resolve(name, capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert main(["--config", str(root / "configs" / f"{name}.yaml"), "--dry_run"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["data"]["train_type"] == EXAMPLES[name]


@pytest.mark.parametrize("name", ["gspo", "rloo", "dapo", "dr_grpo", "reinforce_pp", "ppo"])
def test_an_algorithm_named_as_train_type_gives_its_settings_and_its_config_runs_them(name, capsys):
    """`--train_type gspo` (a name TRL users know) is not a train type: the one error line gives the
    flags that make it, the same as configs/<name>.yaml, which resolves to exactly those settings."""
    from pathlib import Path

    from astrai.config_values import ALGORITHMS, TRAIN_TYPES, algorithm_flags

    assert main(["--train_type", name, "--dry_run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert list(TRAIN_TYPES)[:7] == ["seq", "sft", "dpo", "grpo", "online_grpo", "online_dpo", "online_ppo"]
    assert errors == [f"astrai train: error: train_type={name!r} is not one of {', '.join(TRAIN_TYPES)}: it names an "
                      f"algorithm, {algorithm_flags(name)} (a ready run: configs/{name}.yaml)"]
    root = Path(__file__).resolve().parents[2]
    assert main(["--config", str(root / "configs" / f"{name}.yaml"), "--dry_run"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    flat = {k: v for section in resolved.values() if isinstance(section, dict) for k, v in section.items()}
    assert {k: flat[k] for k in ALGORITHMS[name]} == ALGORITHMS[name]
    assert main(algorithm_flags(name).split() + ["--dry_run"]) == 0  # the flags as printed are a valid run


def test_resume_from_truncated_optimizer_names_the_file(workdir, tmp_path, capsys):
    import shutil

    path = write_config(workdir, max_steps=1)
    assert main(["--config", str(path), "--ckpt_dir", str(tmp_path / "ckpt")]) == 0
    ckpt = tmp_path / "ckpt" / "step_00000001"
    data = (ckpt / "optimizer.pt").read_bytes()
    (ckpt / "optimizer.pt").write_bytes(data[: len(data) // 2])
    shutil.rmtree(workdir / "log", ignore_errors=True)
    code = main(["--config", str(path), "--resume", "--param_path", str(ckpt), "--max_steps", "2"])
    assert code != 0
    assert "optimizer.pt" in capsys.readouterr().err


def test_resume_without_any_checkpoint_is_an_error(workdir, tmp_path, capsys):
    path = write_config(workdir)
    assert main(["--config", str(path), "--resume", "--ckpt_dir", str(tmp_path / "empty")]) != 0
    assert "--resume found no checkpoint" in capsys.readouterr().err


def test_resume_uses_param_path_only_when_it_is_a_training_checkpoint(tmp_path):
    from astrai.config import load_config
    from astrai.train.publish import publish
    from astrai.train.resume import resume_path

    ckpt_dir, prev_run = tmp_path / "ckpt", tmp_path / "prev" / "ckpt"
    for root in (ckpt_dir, prev_run):
        publish(root, 5, lambda d: (d / "trainer_state.json").write_text("{}"))
    explicit = prev_run / "step_00000005"
    cfg = load_config(None, ["--param_path", str(explicit), "--ckpt_dir", str(ckpt_dir)])
    assert resume_path(cfg) == explicit  # a named checkpoint is resumed as asked
    cfg = load_config(None, ["--param_path", str(prev_run), "--ckpt_dir", str(ckpt_dir)])
    assert resume_path(cfg) == ckpt_dir / "step_00000005"  # a chained stage's init: resume this run


# ---------------------------------------------------------------------------- threads and progress lines

TINY_MODEL = ["--vocab_size", "300", "--hidden_size", "16", "--intermediate_size", "32", "--num_hidden_layers", "1",
              "--num_attention_heads", "2", "--num_key_value_heads", "1", "--max_position_embeddings", "64"]


def _tiny_sft(addition_task_dir: Path, tmp_path: Path, *extra: str) -> tuple[list[str], object]:
    from astrai.train.cli import main as train_main

    return ["--train_type", "sft", "--data_path", str(addition_task_dir / "data" / "sft.jsonl"), "--tokenizer_path",
            str(addition_task_dir / "tok"), "--max_seq_len", "32", "--batch_per_device", "4", "--ckpt_dir",
            str(tmp_path / "ckpt"), "--log_dir", str(tmp_path), "--ckpt_interval", "0", *TINY_MODEL, *extra], train_main


def test_train_sets_threads_before_the_build_prints_them_and_restores_the_callers(addition_task_dir, tmp_path, capsys):
    argv, train_main = _tiny_sft(addition_task_dir, tmp_path, "--max_steps", "4", "--warmup_steps", "10",
                                 "--progress", "false", "--threads", "1")
    before = torch.get_num_threads()
    seen = []
    import astrai.train.cli as cli

    real_run = cli.run

    def spy(cfg, ctx, threads_line=""):
        seen.append(torch.get_num_threads())  # what the model is built with
        return real_run(cfg, ctx, threads_line)

    cli.run = spy
    try:
        assert train_main(argv) == 0
    finally:
        cli.run = real_run
    err = capsys.readouterr().err
    assert seen == [1] and torch.get_num_threads() == before
    assert "threads: 1 (torch intra-op per rank; --num_threads)" in err
    # warmup past the run: one line at the start
    assert err.count("warning: warmup_steps 10 is more than the run's 4 optimizer steps") == 1
    # --progress false: periodic lines with step, loss, speed and an ETA, the last at the end
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/4 (25%): loss ") and "tok/s" in lines[0] and "eta " in lines[0]
    assert lines[-1].startswith("step 4/4 (100%): loss ") and "eta" not in lines[-1]


def test_the_cpu_default_is_one_thread_and_the_flag_has_one_spelling_everywhere(monkeypatch):
    from astrai.config import Config
    from astrai.train import cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    before = torch.get_num_threads()
    try:
        assert cli.set_threads(Config(), None).startswith(f"threads: {cli.DEFAULT_CPU_THREADS} (")
        assert torch.get_num_threads() == cli.DEFAULT_CPU_THREADS
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the local launcher's share of the cores for a rank
        assert cli.set_threads(Config(), None).startswith("threads: 2 (torch intra-op per rank; OMP_NUM_THREADS")
    finally:
        torch.set_num_threads(before)
    assert cli.main(["--num_threads", "0"]) == 2
    from astrai.serve.cli import build_parser as serve_parser

    assert serve_parser().parse_args(["--model", "m", "--threads", "1"]).num_threads == 1
    from astrai.demo import main as demo_main

    with pytest.raises(SystemExit):
        demo_main(["--threads", "0"])  # the alias answers, the error names the canonical spelling


def test_prompt_records_under_offline_grpo_name_the_online_train_types(tmp_path, tok_dir, capsys):
    """A TRL user's first try: `--train_type grpo` on prompt records. One error line, at the start,
    naming online_grpo; no line per skipped record."""
    from tests.train.rl_runs import write_rl_run

    config = write_rl_run(tmp_path, tok_dir, num_prompts=200)
    assert main(["--config", str(config), "--train_type", "grpo"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors == [f"astrai train: error: --train_type grpo does not read these records: the first 20 records of "
                      f"{tmp_path / 'prompts.jsonl'} are prompt records ('messages' to answer, with an 'answer'), not "
                      "rollout records ('responses' with their 'rewards'); for prompt records use --train_type "
                      "online_grpo or online_dpo or online_ppo or online_distill"]
    assert "skipped" not in err
