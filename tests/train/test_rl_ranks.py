"""Online RL on two gloo ranks whose samples end at different lengths.

Each rank draws its own prompts and rollouts, so each rank checkpoints its own rollout
(``rollout.pt``, ``rollout_rank1.pt``) and a run stopped inside a reused rollout resumes bit for
bit. Under FSDP the engine generates on an unsharded replica of the policy: were it to run the
sharded module, every engine step would be a collective, and ranks whose samples end at other
lengths take other numbers of steps (a hang). The policy here raises its stop token's logit after
every token, so completions end anywhere from 1 to ``rollout_max_tokens`` tokens; the tests
check that the two ranks' rollouts really differ in length.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from astrai.data.tasks import generate_items, prompt_record
from astrai.train.publish import latest_checkpoint, list_checkpoints, verify_checkpoint
from tests.train.resume_data import MODEL, read_metrics, write_tokenizer

REPO = Path(__file__).resolve().parents[2]
GUARD_S = 300  # a guard against a hung run (the FSDP bug waited forever), not the property under test
EXACT = ("step", "policy_version", "rollout_policy_version", "loss", "grad_norm", "reward_mean", "lr",
         "response_length_mean", "response_length_max")


def write_policy(out: Path, tied: bool = False) -> Path:
    """A tiny policy (and its tokenizer) that stops early often: every embedding shares a constant
    first coordinate and the stop token's lm_head row reads it, so p(stop) is about 0.2 after any
    token and completions end at lengths from 1 to 16 tokens. `tied`: the head is the embedding."""
    from astrai.data.tokenizer import load_tokenizer
    from astrai.model.config import ModelConfig
    from astrai.model.hf import save_model
    from astrai.model.transformer import CausalLM

    tok = load_tokenizer(write_tokenizer(out / "tok"))
    model = CausalLM(ModelConfig.from_dict({**MODEL, "tie_word_embeddings": tied}), seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 8.0
        model.lm_head.weight[tok.stop_token_ids[-1], 0] = 0.7
    save_model(model, out / "model", tok)
    return out / "model"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return write_policy(tmp_path_factory.mktemp("policy"))


def jitter(prompt: str, completion: str, record: dict) -> float:
    """A reward term that draws from Python's RNG once per character of the completion: each rank's
    RNG moves on by its own amount, so a resume must restore every rank's RNG, not rank 0's."""
    draws = [random.random() for _ in range(len(completion) + 1)]
    return 0.1 * draws[-1]


def write_run(run_dir: Path, policy: Path, ckpt_interval: int = 0, max_steps: int = 6) -> Path:
    """online_grpo over 16 prompts: 2 per rank per rollout, 4 samples each, a rollout reused for 2
    steps; the ``length`` reward gives every group a spread, so every step moves the weights."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [prompt_record(it) for it in generate_items(16, ["add"], digits=2, seed=1)]
    (run_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = {
        "data": {"train_type": "online_grpo", "data_path": str(run_dir / "prompts.jsonl")},
        "train": {"param_path": str(policy), "max_steps": max_steps, "batch_per_device": 2, "grad_accum_steps": 2,
                  "device": "cpu", "random_seed": 0, "stop_timeout": 60},
        "optim": {"max_lr": 1e-2, "warmup_steps": 0},
        "rl": {"group_size": 4, "rollout_max_tokens": 16, "max_prompt_len": 100, "rollout_interval": 2,
               "rewards": ["length", "tests.train.test_rl_ranks:jitter"], "length_target": 6},
        "ckpt": {"ckpt_dir": str(run_dir / "ckpt"), "ckpt_interval": ckpt_interval, "keep_last": None},
        "log": {"log_dir": str(run_dir / "log"), "progress": False},
    }
    path = run_dir / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def train(config: Path, *flags: str, pause_at: str | None = None, pause_dir: Path | None = None) -> str:
    """`astrai train --nprocs 2` as a user runs it; with `pause_at` both ranks pause at that event
    (the test hook) until a SIGTERM to the launcher stops them there. Returns the output."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if pause_at is not None:
        env.update({"ASTRAI_PAUSE_AT": pause_at, "ASTRAI_PAUSE_FILE": str(pause_dir / "paused")})
    log_path = config.parent / "launcher.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "astrai", "train", "--config", str(config), "--nprocs", "2",
                                 *flags], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        if pause_at is not None:
            deadline = time.monotonic() + GUARD_S
            while len(list(pause_dir.glob("paused.*"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:  # hung: the launcher kills ranks stuck in a collective after stop_timeout
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=GUARD_S)
            raise
    output = log_path.read_text()
    assert code == 0, output[-3000:]
    return output


def rollout_lengths(ckpt: Path) -> list[list[int]]:
    """Completion lengths (tokens) of each rank's saved rollout, rank 0 first."""
    out = []
    for name in ("rollout.pt", "rollout_rank1.pt"):
        state = torch.load(ckpt / name, weights_only=True)
        out.append((state["labels"] != -100).sum(dim=1).tolist())
    return out


def assert_lengths_differ(lengths: list[list[int]]) -> None:
    """Samples end at different lengths within each rank, and the ranks' longest samples (the
    number of decode steps each rank's engine takes) differ."""
    assert all(len(set(per_rank)) > 2 for per_rank in lengths), lengths
    assert max(lengths[0]) != max(lengths[1]), lengths


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(run_dir / "ckpt") / "model.safetensors"))


def assert_same_run(a: Path, b: Path) -> None:
    got = [{k: m.get(k) for k in EXACT} for m in read_metrics(a)]
    want = [{k: m.get(k) for k in EXACT} for m in read_metrics(b)]
    assert [m["step"] for m in got] == list(range(1, 7))
    assert got == want
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def stop_after_step_3_and_resume(config: Path, tmp_path: Path, *flags: str) -> Path:
    """Stop a run after step 3 (inside the rollout drawn for steps 3 and 4), then resume it;
    returns the stop's checkpoint."""
    output = train(config, *flags, pause_at="step:3", pause_dir=tmp_path)
    assert "stopped at step 3" in output, output[-2000:]
    ckpt = latest_checkpoint(config.parent / "ckpt")
    assert ckpt.name == "step_00000003"
    verify_checkpoint(ckpt)
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"rollout.pt", "rollout_rank1.pt"} <= set(files)
    ranks = [torch.load(ckpt / name, weights_only=True) for name in ("rollout.pt", "rollout_rank1.pt")]
    assert all(r["num_uses"] == 1 and r["policy_version"] == 2 for r in ranks)
    assert not torch.equal(ranks[0]["input_ids"][:, :8], ranks[1]["input_ids"][:, :8])  # each rank's own prompts
    train(config, *flags, "--resume")
    return ckpt


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_fsdp_replica_carries_the_policys_adapters_and_computes_its_logits(tied):
    """In one process: a LoRA policy's replica (the engine's model under FSDP) is a plain module in
    eval mode whose logits after `copy_full_weights` are the policy's own, adapters included; a
    tied policy's replica keeps its head tied (one weight, as in the policy: the tour's model, the
    tools demo's and SmolLM2 are all tied)."""
    from astrai.model.config import ModelConfig
    from astrai.model.lora import adapters_disabled, apply_lora
    from astrai.model.transformer import CausalLM
    from astrai.train import dist
    from astrai.train.rl.engine_sampler import unsharded_replica

    policy = CausalLM(ModelConfig.from_dict({**MODEL, "tie_word_embeddings": tied}), seed=0)
    apply_lora(policy, 4, 8.0, 0.0, ["q", "v", "down"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if name.endswith("lora_B"):  # trained adapters: B is no longer zero
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    replica = unsharded_replica(policy)
    dist.copy_full_weights(policy, replica)
    assert (replica.lm_head.weight is replica.model.embed_tokens.weight) == tied
    assert not replica.training and not any(p.requires_grad for p in replica.parameters())
    ids = torch.randint(0, MODEL["vocab_size"], (2, 12), generator=gen)
    policy.eval()
    with torch.no_grad():
        want = policy(ids).logits
        assert torch.equal(replica(ids).logits, want)
        with adapters_disabled(policy):
            assert not torch.allclose(policy(ids).logits, want)  # the adapters matter here


@pytest.mark.slow
def test_ddp_resumed_mid_rollout_equals_the_uninterrupted_run(tmp_path, policy_dir):
    straight = write_run(tmp_path / "straight", policy_dir)
    stopped = write_run(tmp_path / "stopped", policy_dir)
    output = train(straight, "--parallel_mode", "ddp")
    assert "unsharded replica" not in output  # DDP generates on the live module, no copy
    ckpt = stop_after_step_3_and_resume(stopped, tmp_path, "--parallel_mode", "ddp")
    assert_lengths_differ(rollout_lengths(ckpt))
    assert_same_run(tmp_path / "stopped", tmp_path / "straight")
    for rank in (0, 1):  # each rank's own log (train/timing.py): one line per step, the resume's included
        rows = [json.loads(x) for x in (tmp_path / "stopped" / "log" / "ranks" / f"rank_{rank}.jsonl").read_text()
                .splitlines()]
        assert [r["step"] for r in rows] == [m["step"] for m in read_metrics(tmp_path / "straight")]
        assert all(r["rank"] == rank and r["time_step"] > 0 for r in rows)


@pytest.mark.slow
def test_fsdp_online_rl_generates_on_a_replica_and_resumes_exactly(tmp_path, policy_dir):
    straight = write_run(tmp_path / "straight", policy_dir, ckpt_interval=1)
    output = train(straight, "--parallel_mode", "fsdp")
    assert "unsharded replica of the policy" in output
    # every rollout (steps 1, 3, 5) checkpointed: the ranks' lengths differ in at least one
    rollouts = [rollout_lengths(path) for step, path in list_checkpoints(tmp_path / "straight" / "ckpt")
                if step % 2 == 1]
    assert len(rollouts) == 3
    assert any(max(r[0]) != max(r[1]) for r in rollouts), rollouts
    assert all(len(set(per_rank)) > 2 for r in rollouts for per_rank in r), rollouts
    lines = read_metrics(tmp_path / "straight")
    fresh = [m["sampler_logp_diff"] for m in lines if "sampler_logp_diff" in m]
    assert len(fresh) == 3 and max(fresh) < 1e-5, fresh  # the replica's weights are the trainer's
    assert lines[-1]["policy_version"] == 6

    stopped = write_run(tmp_path / "stopped", policy_dir, ckpt_interval=1)
    stop_after_step_3_and_resume(stopped, tmp_path, "--parallel_mode", "fsdp")
    assert_same_run(tmp_path / "stopped", tmp_path / "straight")


@pytest.mark.slow
def test_fsdp_online_rl_on_a_tied_policy_publishes_its_checkpoints(tmp_path):
    """The tour's model, the tools demo's and SmolLM2 tie their head to the embedding: under FSDP
    the engine's replica must keep the tie (it stopped both ranks before their first rollout).
    One step: a rollout, an update, a checkpoint."""
    config = write_run(tmp_path / "run", write_policy(tmp_path / "policy", tied=True), max_steps=1)
    train(config, "--parallel_mode", "fsdp")
    [(step, path)] = list_checkpoints(tmp_path / "run" / "ckpt")
    assert step == 1
    verify_checkpoint(path)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    fresh = [m["sampler_logp_diff"] for m in read_metrics(tmp_path / "run") if "sampler_logp_diff" in m]
    assert len(fresh) == 1 and fresh[0] < 1e-5, fresh  # the replica computes the trainer's log-probs
