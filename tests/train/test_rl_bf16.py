"""Online RL with ``bf16: true``: rollouts in the training precision (the engine's forward under
the trainer's autocast, a bf16 KV pool), so the sampler's log-probs meet the trainer's bf16 ones."""

from __future__ import annotations

from astrai.config import RLConfig
from astrai.data.tokenizer import load_tokenizer
from astrai.model import CausalLM, ModelConfig
from astrai.train.cli import main
from astrai.train.rl import engine_sampler
from tests.train.resume_data import MODEL, read_metrics
from tests.train.rl_runs import write_rl_run

# sampler_logp_diff of this run's two fresh rollouts, measured over random_seed 0-5 with 1 and 2
# torch threads: bf16 engine 1.8e-5 to 7.4e-5, fp32 engine (rollouts on the fp32 master weights)
# 2.3e-4 to 2.7e-4; the bound sits between with headroom on both sides
BF16_SAMPLER_LOGP_DIFF = 1.2e-4


def test_engine_sampler_precision_follows_bf16(tok_dir):  # noqa: F811
    model = CausalLM(ModelConfig(**MODEL))
    tokenizer, cfg = load_tokenizer(tok_dir), RLConfig(group_size=2, rollout_max_tokens=4)
    runs = {bf16: engine_sampler.EngineSampler(model, tokenizer, 2 * cfg.group_size, 64, bf16=bf16).engine.describe()
            for bf16 in (False, True)}
    assert (runs[False]["autocast_dtype"], runs[False]["kv_cache_dtype"]) == (None, "float32")
    assert (runs[True]["autocast_dtype"], runs[True]["kv_cache_dtype"]) == ("bfloat16", "bfloat16")
    assert runs[True]["kv_cache_tokens"] == runs[False]["kv_cache_tokens"]  # same tokens, half the bytes
    assert 2 * runs[True]["kv_bytes_per_token"] == runs[False]["kv_bytes_per_token"]


def test_online_grpo_bf16_samples_in_the_training_precision(tmp_path, tok_dir, monkeypatch):  # noqa: F811
    engines = []
    init = engine_sampler.EngineSampler.__init__

    def recording_init(self, *args, **kwargs):  # observes the loop's runner, changes nothing
        init(self, *args, **kwargs)
        engines.append(self.engine.describe())

    monkeypatch.setattr(engine_sampler.EngineSampler, "__init__", recording_init)
    config = write_rl_run(tmp_path, tok_dir)
    assert main(["--config", str(config), "--bf16", "true", "--max_steps", "2"]) == 0
    assert [(e["autocast_dtype"], e["kv_cache_dtype"]) for e in engines] == [("bfloat16", "bfloat16")]
    diffs = [m["sampler_logp_diff"] for m in read_metrics(tmp_path)]
    assert len(diffs) == 2 and all(d < BF16_SAMPLER_LOGP_DIFF for d in diffs), diffs
