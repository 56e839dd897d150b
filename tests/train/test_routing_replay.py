"""routing_replay: a MoE policy's rollout rows run through the trainer on the experts the engine
routed each token to, so sampler and trainer agree on the experts even when their routers differ."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import yaml

from astrai.config import load_config
from astrai.config_values import ConfigError
from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from astrai.model import CausalLM, ModelConfig
from astrai.train.cli import main
from astrai.train.losses import IGNORE_INDEX
from astrai.train.objectives import packing
from astrai.train.objectives.logps import at_labels, token_logps
from astrai.train.rl.data import Rollout, concat_rollouts, pack_episodes, routing_rows, select_groups
from astrai.train.rl.sampler import RolloutSampling
from tests.train.resume_data import MODEL, read_metrics
from tests.train.rl_runs import write_rl_run

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def sampled_rollout(model: CausalLM):
    """Two samples each of three prompts, drawn by an engine that records their routing."""
    engine = LLMEngine(model, record_routing=True, kv_cache_tokens=512, block_size=4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (9, 6, 12)]
    outs = engine.run_batch(prompts, SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=1, ignore_eos=True))
    rows, routing = [], []
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            rows.append((prompt + c.token_ids, [None] * len(prompt) + c.logprobs))
            routing.append(c.routing)
    rollout = pack_episodes(rows, 2, 0)
    rollout.routing = routing_rows(routing, rollout.input_ids.size(1))
    rollout.rewards, rollout.texts = torch.zeros(3, 2), [""] * 6
    return rollout


def experts_used(model: CausalLM, run) -> list[torch.Tensor]:
    """The experts every MoE layer used in `run()`'s forward, (rows, width, k) per layer."""
    seen, hooks = [], [m.register_forward_hook(lambda mod, i, o: seen.append(o[3]))
                       for m in model.modules() if type(m).__name__ == "MoE"]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_replay_makes_the_trainer_use_the_samplers_experts_when_its_router_differs():
    model = CausalLM(ModelConfig(**MODEL, **MOE), seed=0)
    rollout = sampled_rollout(model)
    assert rollout.routing.shape == (6, 18, 2, 2) and rollout.routing.dtype == torch.int16
    assert select_groups(rollout, torch.tensor([1])).routing.shape == (2, 18, 2, 2)
    assert concat_rollouts([rollout, select_groups(rollout, torch.tensor([1]))]).routing.shape == (8, 18, 2, 2)
    buffer = io.BytesIO()  # a checkpoint's rollout.pt keeps it for the steps that reuse the rollout on resume
    torch.save(rollout.state_dict(), buffer)
    buffer.seek(0)
    assert torch.equal(Rollout.from_state_dict(torch.load(buffer, weights_only=True)).routing, rollout.routing)
    batch = rollout.rows(slice(None))
    own = {k: v for k, v in batch.items() if k != "routing"}
    sampling = RolloutSampling(temperature=1.0, max_tokens=6)
    labelled = rollout.labels != IGNORE_INDEX

    def sampler_diff(pol) -> torch.Tensor:  # |trainer - sampler| log-prob of every labelled token
        return (pol.logps - at_labels(batch, "old_logps", pol.idx)).abs()[pol.mask]

    # the same weights in fp32: the trainer's own routing is the sampler's, replayed or not
    same = token_logps(model, batch, sampling, layout="pack")
    torch.testing.assert_close(same.logps, token_logps(model, own, sampling, layout="pack").logps, atol=0, rtol=0)
    assert sampler_diff(same).max() < 1e-5
    # a trainer whose routers moved a little (as bf16 rounding moves them): replay keeps the sampler's experts
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for m in moved.modules():
            if type(m).__name__ == "MoE":
                m.gate.weight.add_(torch.randn(m.gate.weight.shape, generator=torch.Generator().manual_seed(2)) * 0.02)
    layout = packing.RowLayout.build(batch["attention_mask"], labelled, "pack")
    recorded = layout.place(batch["routing"], batch["attention_mask"])  # (R, W, 2 layers, k)
    known = recorded[..., 0, 0] >= 0
    replayed = experts_used(moved, lambda: token_logps(moved, batch, sampling, layout="pack"))
    routed = experts_used(moved, lambda: token_logps(moved, own, sampling, layout="pack"))
    for layer in range(2):
        assert torch.equal(replayed[layer][known], recorded[:, :, layer][known].long())
    disagree = sum((routed[layer][known] != recorded[:, :, layer][known]).any(-1).float().mean() for layer in range(2))
    assert disagree > 0.05  # the moved routers do choose other experts for some tokens
    diff = {name: sampler_diff(token_logps(moved, b, sampling, layout="pack")).mean()
            for name, b in (("replay", batch), ("own", own))}
    assert diff["replay"] < diff["own"], diff


@pytest.mark.parametrize("train_type,multi_turn", [("online_grpo", False), ("online_grpo", True), ("online_ppo", False)])
def test_online_rl_with_routing_replay_keeps_fp32_agreement(tmp_path, tok_dir, monkeypatch, train_type, multi_turn):
    """Every token of every row but its last (prompt, sampled, and multi-turn the environment's
    messages and the next turn's prompt, prefilled by the engine) reaches the trainer with the
    sampler's experts."""
    placed = []
    place = packing.RowLayout.place

    def counting_place(self, values, attention_mask, fill=-1):  # observes the trainer's forward, changes nothing
        placed.append((int((values[..., 0, 0] >= 0).sum()), int(attention_mask.sum()) - len(attention_mask)))
        return place(self, values, attention_mask, fill)

    monkeypatch.setattr(packing.RowLayout, "place", counting_place)
    rl = {}
    if multi_turn:  # an environment that answers the first turn, so every episode has a second
        monkeypatch.chdir(tmp_path)
        (tmp_path / "again.py").write_text(
            "from astrai.train.rl.environments import EnvStep\n"
            "class Env:\n    def step(self, messages):\n        done = len(messages) >= 4\n"
            "        return EnvStep(messages=None if done else [{'role': 'user', 'content': 'sure?'}], reward=0.0,"
            " done=done)\n")
        rl = {"environment": "again:Env", "max_turns": 2}
    config = write_rl_run(tmp_path / "run", tok_dir, train_type, routing_replay=True, **rl)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"].update(MOE)
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["--config", str(config), "--max_steps", "2"]) == 0
    metrics = read_metrics(tmp_path / "run")
    diffs = [m["sampler_logp_diff"] for m in metrics]
    assert len(diffs) == 2 and all(d < 1e-5 for d in diffs), diffs
    assert placed and all(recorded == expected for recorded, expected in placed), placed
    if multi_turn:
        assert all(m["turns_per_episode"] == 2 for m in metrics)


def test_routing_replay_is_refused_where_it_cannot_act(tmp_path, tok_dir, capsys):
    config = write_rl_run(tmp_path, tok_dir, routing_replay=True)
    assert main(["--config", str(config), "--max_steps", "1"]) != 0
    err = capsys.readouterr().err
    assert "error: routing_replay=true replays" in err and "no MoE layer (num_experts is 0)" in err, err
    for flags, why in ((["--rollout_servers", "http://127.0.0.1:9"], "do not send it over HTTP"),
                       (["--train_type", "online_dpo"], "train_type online_dpo trains on no such rollouts")):
        with pytest.raises(ConfigError, match=f"routing_replay=true .*{why}"):
            load_config(config, flags)
