"""rl/process_sampler.py: ``async_rollout_source: process`` runs the rollout engine in a spawned
process over weights in shared memory: the same turns as the engine on the rollout thread (so a
run's weights are the thread run's, bit for bit), versions written into the shared weights are what
the child samples from, a child that dies is one clear error, and no child outlives its run."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astrai.config import RLConfig
from astrai.data.tokenizer import load_tokenizer
from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM
from astrai.train.cli import main
from astrai.train.rl.engine_sampler import EngineSampler
from astrai.train.rl.pipeline import rollout_source
from astrai.train.rl.process_sampler import ProcessSampler
from astrai.train.rl.sampler import RolloutSampling, TurnRequest
from tests.train.rl_runs import checkpoint_weights, write_rl_run


def tiny_policy(tok, seed: int = 0) -> CausalLM:
    return CausalLM(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                    seed=seed).eval().requires_grad_(False)


def requests(tok) -> list[TurnRequest]:
    sampling = RolloutSampling(temperature=1.0, max_tokens=6)
    return [TurnRequest(tok.encode(q), sampling, n=3, seed=11 + i) for i, q in enumerate(["1 + 2 =", "7 * 3 ="])]


def turns(sampler, reqs, version: int = 0):
    sampler.set_policy_version(version)
    with sampler.batch(6, 20):
        return [(s.token_ids, s.logprobs, s.finish_reason, r.policy_version)
                for r in sampler.sample(reqs) for s in r.samples]


def test_the_process_samples_what_the_engine_samples_and_follows_written_weights(tok_dir):
    tok = load_tokenizer(tok_dir)
    shared, reference = tiny_policy(tok), tiny_policy(tok)
    sampler = ProcessSampler(shared, tok, num_seqs=6, max_len=32, threads=torch.get_num_threads())  # as here
    try:
        assert turns(sampler, requests(tok)) == turns(EngineSampler(reference, tok, 6, 32), requests(tok))
        other = tiny_policy(tok, seed=1)  # a new version written into the shared weights, as the pipeline does
        with torch.no_grad():
            for mine, new in zip(shared.parameters(), other.parameters()):
                mine.copy_(new)
        assert turns(sampler, requests(tok), version=1) == turns(EngineSampler(other, tok, 6, 32), requests(tok), 1)
    finally:
        sampler.close()
    assert not sampler.process.is_alive()


def test_a_model_of_more_tensors_than_a_fork_server_passes_is_shared_whole(tok_dir):
    """A fork server hands a child at most 256 file descriptors; SmolLM2 has 272 tensors. The
    weights travel as one shared buffer per dtype (tied embeddings stay one tensor)."""
    tok = load_tokenizer(tok_dir)
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=32,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
    shared, reference = (CausalLM(cfg, seed=0).eval().requires_grad_(False) for _ in range(2))
    assert len(list(shared.parameters())) + len(list(shared.buffers())) > 256
    sampler = ProcessSampler(shared, tok, num_seqs=6, max_len=32, threads=torch.get_num_threads())
    try:
        assert shared.lm_head.weight is shared.model.embed_tokens.weight
        assert turns(sampler, requests(tok)) == turns(EngineSampler(reference, tok, 6, 32), requests(tok))
    finally:
        sampler.close()


def test_a_child_that_dies_is_one_error_naming_its_exit_code(tok_dir):
    tok = load_tokenizer(tok_dir)
    sampler = ProcessSampler(tiny_policy(tok), tok, num_seqs=6, max_len=32, threads=1)
    os.kill(sampler.process.pid, signal.SIGKILL)
    sampler.process.join(30)
    with pytest.raises(RuntimeError, match=rf"the rollout process \(pid {sampler.process.pid}\) exited with code -9 "
                                           r"while generating;.*--async_rollout_source thread"):
        sampler.sample(requests(tok))
    sampler.close()


def run(run_dir: Path, tok_dir: Path, source: str) -> Path:
    config = write_rl_run(run_dir, tok_dir, async_steps=1, async_rollout_source=source, rewards=["length"],
                          length_target=4)
    assert main(["--config", str(config), "--max_steps", "3"]) == 0
    return run_dir


def test_a_process_run_ends_with_the_thread_runs_weights_and_leaves_no_child(tmp_path, tok_dir):
    process, thread = run(tmp_path / "process", tok_dir, "process"), run(tmp_path / "thread", tok_dir, "thread")
    assert multiprocessing.active_children() == []  # the run's end joined its rollout process
    a, b = checkpoint_weights(process), checkpoint_weights(thread)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_without_room_in_shared_memory_auto_takes_the_thread_and_process_says_why(tok_dir, monkeypatch, capsys):
    tok = load_tokenizer(tok_dir)
    model = tiny_policy(tok)
    assert rollout_source(RLConfig(async_steps=1), model, torch.device("cpu")) == "process"
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096))
    assert rollout_source(RLConfig(async_steps=1), model, torch.device("cpu")) == "thread"
    assert "which has 0 MiB free (a container's default is 64 MB), so the engine runs on the rollout thread" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match=r"shares the copy of the weights \(0 MiB\) through /dev/shm, which has 0 MiB "
                                         r"free .*; give it more \(docker run --shm-size.* --async_rollout_source thread"):
        ProcessSampler(model, tok, num_seqs=6, max_len=32, threads=1)
