"""Online RL drawing its rollouts from an `astrai serve` process (rl/http_sampler.py): `astrai
train --rollout_servers URL` trains with the trainer's and the server's log-probs within 1e-5
(fp32), the server ends on the trainer's final policy version, a SIGTERM and `--resume` give the
uninterrupted run's weights bit for bit (one server, one rank), the broadcast transport gives the
filesystem one's run, a LoRA run sends only its adapter (by either transport the server then holds the
trainer's merged weights, with fewer bytes sent), a server that refuses a broadcast load ends the sync
at once instead of leaving the trainer in the collective, and a dead server is named."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import yaml

from astrai.data.tokenizer import load_tokenizer
from astrai.model.config import ModelConfig
from astrai.model.hf import save_model
from astrai.model.transformer import CausalLM
from astrai.train.rl.http_sampler import HttpSampler, RolloutServerError
from tests.serve.conftest import ServerProcess
from tests.train.resume_data import MODEL, train_in_process
from tests.train.rl_runs import (
    checkpoint_weights,
    eval_file,
    eval_rows,
    sigterm_after_step,
    with_eval,
    write_rl_run,
)

ADMIN_KEY = "admin-key"


@pytest.fixture(scope="module")
def rollout_server(tok_dir, tmp_path_factory):
    """One `astrai serve` of the run's architecture, fp32, admin routes on; deterministic settings
    (no probed chunk, thread count or weight layout) so its batches are the same in every run."""
    root = tmp_path_factory.mktemp("server")
    model_dir, weights = root / "model", root / "weights"
    weights.mkdir()
    save_model(CausalLM(ModelConfig(**MODEL), seed=0), model_dir, tokenizer=load_tokenizer(tok_dir))
    server = ServerProcess(model_dir, "--max_model_len", "128", "--admin_key", ADMIN_KEY, "--weights_dir",
                           str(weights), "--dtype", "float32", "--long_prefill_token_threshold", "0",
                           "--num_threads", "1", "--linear_layout", "out_in", api_key=None).start()
    yield server, weights, model_dir
    server.stop()


def _run_config(run_dir, tok_dir, server, weights, max_steps: int = 2, **rl):
    config = write_rl_run(run_dir, tok_dir, rollout_servers=[server.base_url], rollout_admin_key=ADMIN_KEY,
                          rollout_weights_dir=str(weights), rollout_retries=0, **rl)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["max_steps"] = max_steps
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config




def test_train_from_a_server_matches_its_logprobs_and_resumes_exactly(rollout_server, tok_dir, tmp_path,
                                                                     monkeypatch):
    server, weights, _ = rollout_server
    full = _run_config(tmp_path / "full", tok_dir, server, weights)
    assert train_in_process(full, monkeypatch=monkeypatch) == 0
    rows = [json.loads(line) for line in (tmp_path / "full" / "log" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "sampler_logp_diff" in r]
    assert len(steps) == 2 and all(r["sampler_logp_diff"] <= 1e-5 for r in steps), steps
    assert all(r["rollout_policy_version"] == r["step"] - 1 and r["weight_sync_seconds"] > 0 for r in steps)
    card = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]
    assert card["policy_version"] == 2  # the trainer's final version, loaded after its last step

    stopped = _run_config(tmp_path / "stopped", tok_dir, server, weights)
    sigterm_after_step(stopped, 1, tmp_path)
    assert train_in_process(stopped, "--resume", monkeypatch=monkeypatch) == 0
    want, got = checkpoint_weights(tmp_path / "full"), checkpoint_weights(tmp_path / "stopped")
    assert all(torch.equal(want[k], got[k]) for k in want)

    # the broadcast transport delivers the same weights: the same samples, the same run, bit for bit
    # (with evaluation during training: greedy and sampled episodes in one turn, after the last step)
    broadcast = _run_config(tmp_path / "broadcast", tok_dir, server, weights, rollout_weight_transport="broadcast")
    assert train_in_process(with_eval(broadcast, eval_file(tmp_path / "eval.jsonl", num=4)), monkeypatch=monkeypatch) == 0
    assert [r["step"] for r in eval_rows(tmp_path / "broadcast")][-1] == 2
    got = checkpoint_weights(tmp_path / "broadcast")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["policy_version"] == 2


def test_async_steps_sends_each_version_from_the_rollout_thread(rollout_server, tok_dir, tmp_path, monkeypatch):
    """async_steps 1 from a server: the rollout thread loads version v into the server while the
    trainer computes the next step; the lag is fixed, two runs end with the same weights, and the
    server ends on the final version."""
    server, weights, _ = rollout_server
    for name in ("a", "b"):
        config = _run_config(tmp_path / name, tok_dir, server, weights, max_steps=3, async_steps=1,
                             rewards=["length"], length_target=4)  # a spread: every step moves the weights
        assert train_in_process(config, monkeypatch=monkeypatch) == 0
    rows = [json.loads(line) for line in (tmp_path / "a" / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_lag"] for r in rows] == [0, 1, 1]
    assert [r["rollout_policy_version"] for r in rows] == [0, 0, 1] and rows[-1]["loss"] != 0
    a, b = checkpoint_weights(tmp_path / "a"), checkpoint_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["policy_version"] == 3


def test_a_lora_run_sends_only_its_adapter(rollout_server, tok_dir, tmp_path, monkeypatch):
    server, weights, model_dir = rollout_server
    config = _run_config(tmp_path, tok_dir, server, weights)
    cfg = yaml.safe_load(config.read_text())
    del cfg["model"]
    cfg["train"]["param_path"] = str(model_dir)  # the base the server serves
    cfg["lora"] = {"lora_r": 4, "lora_alpha": 8.0}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert train_in_process(config, monkeypatch=monkeypatch) == 0
    [published] = weights.glob("policy_*")
    assert (published / "adapter_model.safetensors").is_file() and not (published / "model.safetensors").exists()
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sampler_logp_diff"] <= 1e-5 for r in rows if "sampler_logp_diff" in r)
    assert httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["policy_version"] == 2


def test_a_dead_server_is_named(tmp_path):
    from tests.serve.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RolloutServerError, match=f"rollout server {url} failed to connect"):
        HttpSampler([url], torch.nn.Linear(1, 1), None, tmp_path, retries=0, timeout=5)


def test_broadcast_loads_the_policy_and_a_server_that_refuses_stops_the_sync_at_once(tmp_path):
    """On an in-process server: the broadcast (gloo on the CPU) leaves the trainer's weights in the
    server; when the server has lost its group (a restarted server) its 409 ends the sync at once,
    naming it, while the collective would wait for the group's timeout."""
    from astrai.model.hf import load_model
    from tests.serve.conftest import API_KEY, make_model_dir
    from tests.serve.live import GUARD_S, LiveServer, serve_config

    model_dir = make_model_dir(tmp_path / "base")
    config = serve_config(model_dir, admin_key=ADMIN_KEY, weights_dir=str(tmp_path))
    with LiveServer(config) as live:
        policy = CausalLM(load_model(model_dir).config, seed=3)
        sampler = HttpSampler([live.base], policy, load_tokenizer(model_dir), tmp_path, admin_key=ADMIN_KEY,
                              api_key=API_KEY, timeout=GUARD_S, retries=0, transport="broadcast")
        sampler.sync_weights(1)
        served = live.app.state.serve.engine.engine.model.state_dict()
        assert sampler.backend == "gloo" and all(torch.equal(served[k], v) for k, v in policy.state_dict().items())
        assert sampler.sync_bytes == sum(t.numel() * t.element_size() for t in policy.state_dict().values())
        kept, live.app.state.serve.weight_group = live.app.state.serve.weight_group, None  # alive, never receiving
        with pytest.raises(RolloutServerError, match=f"rollout server {live.base} failed to load policy version 2 "
                                                     r"\(broadcast transport, gloo\).*HTTP 409"):
            sampler.sync_weights(2)
        assert sampler.group is None  # the next sync opens a new group
        sampler.close()
        kept.group.abort()


def test_a_lora_policy_sends_its_adapter_and_the_server_holds_the_merged_weights(tmp_path, capsys):
    """Broadcast and filesystem: only the adapter travels (fewer bytes than the merged weights), the
    server merges it onto the base it read and holds the trainer's merged weights (fp32, within 1e-6),
    and again after the adapter moved (no merge on top of the last one). A base the server does not
    read: the merged weights travel, and the run says so."""
    from astrai.model.hf import load_model
    from astrai.model.lora import apply_lora, lora_state_dict, merged_state_dict
    from tests.serve.conftest import API_KEY, make_model_dir
    from tests.serve.live import GUARD_S, LiveServer, serve_config

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors.values())

    model_dir = make_model_dir(tmp_path / "base")
    weights = tmp_path / "weights"
    weights.mkdir()
    with LiveServer(serve_config(model_dir, admin_key=ADMIN_KEY, weights_dir=str(weights))) as live:
        policy = load_model(model_dir)
        apply_lora(policy, r=2, alpha=4.0)
        full = nbytes(merged_state_dict(policy))

        def move_adapter(seed):
            with torch.no_grad():
                for name, p in lora_state_dict(policy).items():
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + len(name))) * 0.1)

        def assert_served_is_merged():
            served, want = live.app.state.serve.engine.engine.model.state_dict(), merged_state_dict(policy)
            assert set(served) == set(want)
            assert all(torch.allclose(served[k], want[k], rtol=0, atol=1e-6) for k in want)

        samplers = {t: HttpSampler([live.base], policy, load_tokenizer(model_dir), weights, admin_key=ADMIN_KEY,
                                   api_key=API_KEY, timeout=GUARD_S, retries=0, transport=t,
                                   base_model=str(model_dir)) for t in ("broadcast", "filesystem")}
        broadcast = samplers["broadcast"]
        for version, seed in ((1, 10), (2, 20)):
            move_adapter(seed)
            broadcast.sync_weights(version)
            assert_served_is_merged()
        assert broadcast.adapter is not None and broadcast.sync_bytes == 2 * nbytes(lora_state_dict(policy)) < full
        move_adapter(30)
        samplers["filesystem"].sync_weights(3)
        assert_served_is_merged()
        assert 0 < samplers["filesystem"].sync_bytes < full

        elsewhere = HttpSampler([live.base], policy, load_tokenizer(model_dir), weights, admin_key=ADMIN_KEY,
                                api_key=API_KEY, timeout=GUARD_S, retries=0, transport="broadcast",
                                base_model=str(tmp_path / "another-base"))
        move_adapter(40)
        elsewhere.sync_weights(4)
        assert_served_is_merged()
        assert elsewhere.adapter is None and elsewhere.sync_bytes == full
        assert "sends the merged weights, not only the adapter" in capsys.readouterr().err
        for sampler in (*samplers.values(), elsewhere):
            sampler.close()
