"""Distillation (`online_distill`, `kd`): the student's reverse KL to a teacher falls over a short
run, and a weaker student's held-out accuracy rises toward its teacher's; a teacher behind
`astrai serve` (`teacher_url`, with an API key) gives the in-process teacher's log-probs; the
settings that cannot work are refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from astrai.cli import main as astrai_main
from astrai.config import load_config
from astrai.config_values import ConfigError
from astrai.data.tokenizer import load_tokenizer
from astrai.data.tokenizer_training import train_tokenizer
from astrai.model.config import ModelConfig
from astrai.model.hf import save_model
from astrai.model.transformer import CausalLM
from astrai.train import signals
from astrai.train.losses import IGNORE_INDEX
from astrai.train.objectives.teacher import LocalTeacher, RemoteTeacher, build_teacher
from astrai.train.publish import latest_checkpoint
from astrai.train.rl.data import Rollout
from tests.train.resume_data import MODEL, read_metrics, train_in_process, write_run
from tests.train.rl_runs import write_rl_run


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tok_dir):
    """The task's SFT model after 60 steps from the student's own initialisation (seed 0): it
    answers in the task's format where the untrained student spreads its mass."""
    root = tmp_path_factory.mktemp("teacher")
    config = write_run(root, tok_dir, "sft", num_records=64, max_steps=60, batch_per_device=8)
    assert train_in_process(config, monkeypatch=pytest.MonkeyPatch()) == 0
    return latest_checkpoint(root / "ckpt")


def distill_run(run_dir, tok_dir, teacher, steps: int, rollout_interval: int = 1, **objective):
    config = write_rl_run(run_dir, tok_dir, "online_distill", rewards=[], group_size=4, rollout_max_tokens=8,
                          rollout_interval=rollout_interval)
    cfg = yaml.safe_load(config.read_text())
    cfg["objective"] = {"teacher_path": str(teacher), **objective}
    cfg["train"].update(max_steps=steps, batch_per_device=16, grad_accum_steps=1)
    cfg["optim"].update(max_lr=1e-2, warmup_steps=3)
    config.write_text(yaml.safe_dump(cfg))
    return config


@pytest.mark.slow
def test_online_distill_lowers_the_students_reverse_kl(tmp_path, tok_dir, teacher_dir, monkeypatch):
    # measured over 20 steps, seeds 0-2 (1 and 2 threads alike): distill/reverse_kl from 1.37-1.56
    # (mean of the first 3 steps) to 0.35-0.49 (last 3), a ratio of 0.26-0.34; 0.6 leaves room
    config = distill_run(tmp_path, tok_dir, teacher_dir, 20)
    assert train_in_process(config, monkeypatch=monkeypatch) == 0
    rows = read_metrics(tmp_path)
    kl = [m["distill/reverse_kl"] for m in rows]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert last < 0.6 * first, kl
    assert all(m["distill/teacher_seconds"] >= 0 for m in rows)


def test_online_distill_jsd_with_a_task_reward_trains(tmp_path, tok_dir, teacher_dir, monkeypatch):
    config = distill_run(tmp_path, tok_dir, teacher_dir, 2, distill_loss="jsd", distill_beta=0.5, distill_coef=0.5)
    config.write_text(config.read_text().replace("rewards: []", "rewards: [format]"))
    assert train_in_process(config, monkeypatch=monkeypatch) == 0
    rows = read_metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["distill/jsd"] > 0 for m in rows)


def _rollout(tok) -> Rollout:
    """Three rows of chat prompt + reply, right-padded, labels on the replies."""
    rows, labels = [], []
    for question, reply in (("12+30=", "42"), ("7-5=", "2 and some more words"), ("1+1=", "11")):
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ids = prompt + tok.encode(reply)
        rows.append(ids)
        labels.append([IGNORE_INDEX] * (len(prompt) - 1) + ids[len(prompt):] + [IGNORE_INDEX])
    T = max(map(len, rows))
    pad = lambda r, v: r + [v] * (T - len(r))  # noqa: E731
    input_ids = torch.tensor([pad(r, 0) for r in rows])
    return Rollout(input_ids=input_ids, attention_mask=torch.tensor([pad([1] * len(r), 0) for r in rows]),
                   labels=torch.tensor([pad(r, IGNORE_INDEX) for r in labels]), old_logps=torch.zeros(3, T),
                   rewards=torch.zeros(3, 1), group_size=1, policy_version=0)


def test_teacher_url_gives_the_local_teachers_logps(tmp_path, tok_dir, monkeypatch):
    from astrai.serve.state import ServeConfig
    from tests.serve.conftest import API_KEY
    from tests.serve.live import SERVER_ENGINE, LiveServer

    teacher = tmp_path / "teacher"
    save_model(CausalLM(ModelConfig(**MODEL), seed=3), teacher, load_tokenizer(tok_dir))
    cfg = load_config(None, ["--train_type", "online_distill", "--teacher_path", str(teacher),
                             "--tokenizer_path", str(tok_dir)])
    rollout = _rollout(load_tokenizer(tok_dir))
    local = LocalTeacher(str(teacher), torch.device("cpu"), cfg).label_logps(rollout)
    monkeypatch.setenv("TEACHER_KEY", API_KEY)
    with LiveServer(ServeConfig(str(teacher), api_key=API_KEY, engine_kwargs=dict(SERVER_ENGINE))) as server:
        # a server started with --api_key: the key of teacher_api_key_env's variable, as a bearer token
        cfg = load_config(None, ["--train_type", "online_distill", "--teacher_url", server.base,
                                 "--teacher_api_key_env", "TEACHER_KEY", "--tokenizer_path", str(tok_dir)])
        remote = build_teacher(cfg, CausalLM(ModelConfig(**MODEL))).label_logps(rollout)
        with pytest.raises(ValueError, match="answered 401 .unauthorized.; set teacher_api_key_env") as refused:
            RemoteTeacher(server.base).label_logps(rollout)  # no key: one line naming the field, at once
        assert API_KEY not in str(refused.value)
        monkeypatch.setenv("TEACHER_KEY", "wrong")
        with pytest.raises(ValueError, match="answered 401") as refused:
            RemoteTeacher(server.base, api_key_env="TEACHER_KEY").label_logps(rollout)
        assert "wrong" not in str(refused.value)  # the key is never written out
    monkeypatch.delenv("TEACHER_KEY")
    with pytest.raises(ValueError, match="teacher_api_key_env='TEACHER_KEY' names an environment variable that is not"):
        RemoteTeacher("http://127.0.0.1:9", api_key_env="TEACHER_KEY")
    labelled = rollout.labels != IGNORE_INDEX
    assert bool((local[labelled] < 0).all()) and bool((local[~labelled] == 0).all())
    assert torch.allclose(remote, local, atol=1e-5, rtol=0), (remote - local).abs().max()


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, tok_dir):
    other = tmp_path / "other_tok"
    train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, 280, other, min_frequency=1)
    teacher = tmp_path / "teacher"
    save_model(CausalLM(ModelConfig(**MODEL), seed=3), teacher, load_tokenizer(other))
    cfg = load_config(None, ["--train_type", "online_distill", "--teacher_path", str(teacher),
                             "--tokenizer_path", str(tok_dir)])
    with pytest.raises(ValueError, match=r"own tokenizer \(\d+ tokens\) but the policy's tokenizer \(\d+ tokens"):
        LocalTeacher(str(teacher), torch.device("cpu"), cfg)


@pytest.mark.parametrize("flags, message", [
    ([], "needs one teacher, got neither"),
    (["--teacher_path", "t", "--teacher_url", "http://x"], "needs one teacher, got both"),
    (["--teacher_url", "http://x", "--distill_loss", "jsd"], "distill_loss=jsd compares full distributions"),
    (["--teacher_url", "http://x", "--distill_coef", "1", "--rewards", "[]"], "rewards is empty"),
    (["--teacher_url", "http://x", "--dynamic_sampling", "true"], "dynamic_sampling drops groups"),
    (["--teacher_path", "t", "--teacher_api_key_env", "K"], "teacher_api_key_env='K' is the API key of teacher_url"),
])
def test_distill_settings_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--train_type", "online_distill", *flags])


def test_pure_distillation_needs_no_reward(tmp_path):
    cfg = load_config(None, ["--train_type", "online_distill", "--teacher_url", "http://x", "--rewards", "[]"])
    assert cfg.rl.rewards == [] and json.dumps(cfg.to_dict())


@pytest.mark.slow
def test_online_distill_resumes_exactly(tmp_path, tok_dir, teacher_dir):
    """A stop after step 3 (inside a rollout reused for two steps, its teacher scores pinned on it)
    resumes bit for bit."""
    from tests.train.rl_runs import checkpoint_weights, sigterm_after_step

    runs = {}
    for name in ("straight", "stopped"):
        runs[name] = distill_run(tmp_path / name, tok_dir, teacher_dir, 4, rollout_interval=2)
        runs[name].write_text(runs[name].read_text().replace("batch_per_device: 16", "batch_per_device: 4"))
    assert train_in_process(runs["straight"], monkeypatch=pytest.MonkeyPatch()) == 0
    sigterm_after_step(runs["stopped"], 3, tmp_path)
    assert train_in_process(runs["stopped"], "--resume", monkeypatch=pytest.MonkeyPatch()) == 0
    keys = ("step", "loss", "grad_norm", "distill/reverse_kl", "lr")
    got = [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "stopped")]
    assert got == [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "straight")]
    a, b = checkpoint_weights(tmp_path / "stopped"), checkpoint_weights(tmp_path / "straight")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_kd_adds_an_moe_students_load_balancing_loss(tmp_path):
    from astrai.train.objectives.distill import KDObjective
    from tests.train.toydata import ToySeqDataset
    from tests.train.trainer_utils import tiny_config, tiny_model

    save_model(tiny_model(seed=1), tmp_path / "teacher")
    student = tiny_model(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
    ds = ToySeqDataset(8)
    batch = ds.collate([ds[i] for i in range(8)])
    cfg = tiny_config(tmp_path, "--train_type", "kd", "--teacher_path", str(tmp_path / "teacher"))
    out = KDObjective(cfg, student)(student, batch)
    m = out.metrics
    assert {"aux_loss", "aux_loss_weighted", "router/entropy"} <= set(m)
    torch.testing.assert_close(out.loss.detach(), m["distill/jsd"] + 0.5 * m["aux_loss"])


def test_kd_brings_the_student_towards_the_teacher_on_sft_records(tmp_path, tok_dir, teacher_dir, monkeypatch):
    # measured over 12 steps, student seeds 1-3 (1 and 2 threads alike): the JSD falls from 0.35-0.36
    # to 0.054-0.066, a ratio of 0.15-0.18; 0.5 leaves room
    config = write_run(tmp_path, tok_dir, "sft", num_records=64, max_steps=12, batch_per_device=8)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["train_type"] = "kd"
    cfg["objective"] = {"teacher_path": str(teacher_dir), "distill_beta": 0.5}
    cfg["train"]["random_seed"] = 1  # another student than the teacher's own start
    cfg["optim"]["max_lr"] = 1e-2
    config.write_text(yaml.safe_dump(cfg))
    assert train_in_process(config, monkeypatch=monkeypatch) == 0
    rows = read_metrics(tmp_path)
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], [m["loss"] for m in rows]
    assert rows[0]["distill/jsd"] == pytest.approx(rows[0]["loss"])


HELD_OUT_SEED = 0  # the spread in the test's docstring was measured at seeds 0-4


@pytest.mark.slow
def test_online_distill_raises_a_weaker_students_held_out_accuracy(tmp_path, tok_dir):
    """The teacher is an SFT model of 1-digit addition (150 steps from scratch); the student is that
    model after 15 more SFT steps on replies followed by " ok", so it answers in a form the task's
    exact match refuses. 30 steps of on-policy distillation on the training prompts bring the
    student back to the teacher's form, and its sampled accuracy on the 40 held-out sums (16
    samples each, never in any training file) rises: the teacher's signal on training prompts
    carries over to prompts the student never distilled on.
    Measured at seeds 0-4 (teacher, student and distillation seed alike; training at 1 thread):
    teacher 0.24-0.35, student 0.000-0.045, distilled 0.116-0.258 sampled held-out accuracy, a rise
    of 0.116 / 0.168 / 0.235 (min / mean / max); 20 steps at lr 1e-3 rose only 0.014 at seed 4.
    The assertion asks half the smallest rise, 0.06. About 7-13 s."""
    from astrai.data.tasks import write_task_files
    from astrai.eval import SCORERS, read_prompt_records
    from astrai.infer.llm import LLM
    from astrai.infer.sampling import SamplingParams

    files = write_task_files(tmp_path / "data", num_train=2000, num_eval=40, tasks=("add",), digits=1, seed=0)
    ok = tmp_path / "data" / "sft_ok.jsonl"
    rows = [json.loads(line) for line in files["sft"].read_text().splitlines()]
    ok.write_text("".join(json.dumps({"messages": r["messages"][:-1] + [
        {"role": "assistant", "content": r["messages"][-1]["content"] + " ok"}]}) + "\n" for r in rows))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"model": {**MODEL, "hidden_size": 64, "intermediate_size": 128}}))
    common = ["--tokenizer_path", tok_dir, "--random_seed", HELD_OUT_SEED, "--device", "cpu", "--num_threads", 1,
              "--progress", "false", "--ckpt_interval", 0, "--keep_last", 1, "--n_epoch", 1000]
    sft = ["--train_type", "sft", "--max_seq_len", 32, "--batch_per_device", 32, "--max_lr", 3e-3]

    def train(name: str, *flags) -> Path:
        args = [*flags, *common, "--ckpt_dir", tmp_path / name / "ckpt", "--log_dir", tmp_path / name]
        try:
            assert astrai_main(["train", *map(str, args)]) == 0
        finally:
            signals.uninstall_signal_handlers()
        return latest_checkpoint(tmp_path / name / "ckpt")

    def sampled_accuracy(model_dir) -> float:
        records = read_prompt_records(files["eval"])
        params = SamplingParams(temperature=1.0, max_tokens=8, n=16, seed=1234)
        outputs = LLM(str(model_dir)).chat([r["messages"] for r in records], params)
        right = [SCORERS["exact"](c.text, r["answer"]) for r, o in zip(records, outputs) for c in o.outputs]
        return sum(right) / len(right)

    teacher = train("teacher", "--config", tmp_path / "model.yaml", *sft, "--data_path", files["sft"],
                    "--max_steps", 150, "--warmup_ratio", 0.05)
    student = train("student", *sft, "--data_path", ok, "--param_path", teacher, "--max_steps", 15)
    distilled = train("distill", "--train_type", "online_distill", "--data_path", files["prompts"],
                      "--param_path", student, "--teacher_path", teacher, "--rewards", "[]", "--max_steps", 30,
                      "--batch_per_device", 32, "--group_size", 4, "--rollout_max_tokens", 8, "--max_prompt_len", 32,
                      "--max_lr", 2e-3, "--schedule", "constant", "--warmup_steps", 2)
    before, after = sampled_accuracy(student), sampled_accuracy(distilled)
    print(f"held-out sampled accuracy: teacher {sampled_accuracy(teacher):.3f}, student {before:.3f} -> "
          f"distilled {after:.3f}")
    assert after >= before + 0.06, (before, after)
