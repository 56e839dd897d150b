"""LoRA runs end to end: config fields, only adapters train, adapter-only PEFT checkpoints, exact
resume, the adapter-disabled reference of DPO / GRPO / PPO (no second model), and serving the
adapter with --lora."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from astrai.cli import main as astrai_main
from astrai.config import ConfigError, load_config
from astrai.model.hf import load_model, save_model
from astrai.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterDisabled, LoraLinear
from astrai.model.transformer import CausalLM
from astrai.train import signals
from astrai.train.publish import latest_checkpoint, verify_checkpoint
from tests.train.resume_data import MODEL, read_metrics, train_in_process, write_run
from tests.train.rl_runs import write_rl_run


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tok_dir):
    from astrai.data.tokenizer import load_tokenizer
    from astrai.model.config import ModelConfig

    path = tmp_path_factory.mktemp("base")
    save_model(CausalLM(ModelConfig(**MODEL), seed=0), path, tokenizer=load_tokenizer(tok_dir))
    return path


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    yield
    signals.uninstall_signal_handlers()


def lora_run(config: Path, base_dir: Path, **lora) -> Path:
    """Turn a run config into a LoRA run on `base_dir`."""
    cfg = yaml.safe_load(config.read_text())
    del cfg["model"]
    cfg["train"]["param_path"] = str(base_dir)
    cfg["lora"] = {"lora_r": 4, "lora_alpha": 8.0, **lora}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config


def test_lora_fields_defaults_and_checks():
    cfg = load_config(None, [])
    assert (cfg.lora.lora_r, cfg.lora.lora_alpha, cfg.lora.lora_dropout) == (0, 16.0, 0.0)
    assert cfg.lora.lora_targets == ["q", "k", "v", "o", "gate", "up", "down"]
    assert load_config(None, ["--lora_targets", "[q, v_proj]"]).lora.lora_targets == ["q", "v_proj"]
    with pytest.raises(ConfigError, match="lora_targets"):
        load_config(None, ["--lora_targets", "[qkv]"])
    with pytest.raises(ConfigError, match="lora_r=-1"):
        load_config(None, ["--lora_r", "-1"])


def test_lora_needs_a_base_model(tmp_path, tok_dir, capsys):
    config = write_run(tmp_path, tok_dir, "sft")
    assert astrai_main(["train", "--config", str(config), "--lora_r", "4"]) == 1
    assert "lora_r=4 needs --param_path" in capsys.readouterr().err


def test_sft_lora_run_trains_adapters_only_and_checkpoints_a_peft_adapter(tmp_path, tok_dir, base_dir, capsys):
    config = lora_run(write_run(tmp_path, tok_dir, "sft", max_steps=3), base_dir, lora_targets=["q", "v"])
    before = {k: v.clone() for k, v in load_file(str(base_dir / "model.safetensors")).items()}
    assert astrai_main(["train", "--config", str(config)]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    # 2 layers x r=4 x ((in + out) of q: 32 + 32, of v: 32 + 16 (2 kv heads x head_dim 8))
    lora_params = 2 * 4 * ((32 + 32) + (32 + 16))
    assert first.startswith(f"trainable parameters: {lora_params:,} of ")
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    verify_checkpoint(ckpt)
    files = set(json.loads((ckpt / "manifest.json").read_text())["files"])
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json", "optimizer.pt", "scheduler.pt",
            "trainer_state.json"} <= files
    assert "model.safetensors" not in files and "config.json" not in files  # never a copy of the base
    adapter = json.loads((ckpt / ADAPTER_CONFIG).read_text())
    assert adapter["base_model_name_or_path"] == str(base_dir.resolve())
    assert adapter["target_modules"] == ["q_proj", "v_proj"]
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(optim["state"]) == 8 and all(".lora_" in name for name in optim["state"])  # only adapters
    after = load_file(str(base_dir / "model.safetensors"))
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the base stays untouched
    # the checkpoint is a model for load_model: base + trained adapter
    merged = load_model(ckpt)
    base = load_model(base_dir)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])


def _extra_bytes(objective, model) -> int:
    """Bytes of tensor storage held by the objective (its modules, and modules held by the
    objects it holds, e.g. the reference) beyond the storage of `model` itself."""
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    modules = []
    for value in vars(objective).values():
        for v in [value, *(vars(value).values() if hasattr(value, "__dict__") else [])]:
            if isinstance(v, torch.nn.Module):
                modules.append(v)
    seen, total = set(owned), 0
    for t in (t for m in modules for t in [*m.parameters(), *m.buffers()]):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def test_dpo_reference_under_lora_is_the_same_module_without_a_copy(tmp_path, tok_dir, base_dir):
    from astrai.train.build import build_model
    from astrai.train.objectives import DPOObjective

    cfg = load_config(None, ["--train_type", "dpo", "--param_path", str(base_dir), "--lora_r", "4"])
    model = build_model(cfg)
    objective = DPOObjective(cfg, model)
    assert isinstance(objective.reference, AdapterDisabled) and objective.reference.model is model
    assert _extra_bytes(objective, model) == 0  # no second model
    full_cfg = load_config(None, ["--train_type", "dpo", "--param_path", str(base_dir)])
    full_model = build_model(full_cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in full_model.parameters())
    assert _extra_bytes(DPOObjective(full_cfg, full_model), full_model) >= model_bytes  # a full run's frozen copy
    # at step 0 the adapters add nothing, so policy and reference agree: the DPO loss is log 2
    B, T = 2, 6
    ids = torch.randint(0, 300, (B, T))
    batch = {f"{side}_{k}": v for side in ("chosen", "rejected") for k, v in
             (("input_ids", ids), ("labels", ids), ("attention_mask", torch.ones(B, T, dtype=torch.long)),
              ("position_ids", torch.arange(T).expand(B, T)))}
    out = objective(model, batch)
    torch.testing.assert_close(out.loss / B, torch.log(torch.tensor(2.0)))
    out.loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not n.endswith(("lora_A", "lora_B")))


def test_dpo_lora_run(tmp_path, tok_dir, base_dir):
    config = lora_run(write_run(tmp_path, tok_dir, "dpo", max_steps=2), base_dir)
    assert astrai_main(["train", "--config", str(config)]) == 0
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    assert (latest_checkpoint(tmp_path / "ckpt") / ADAPTER_WEIGHTS).is_file()


@pytest.mark.parametrize("train_type", ["online_grpo", "online_ppo"])
def test_online_rl_under_lora_uses_the_adapter_disabled_reference(tmp_path, tok_dir, base_dir, train_type):
    from astrai.train.rl.loop import OnlineLoop

    config = lora_run(write_rl_run(tmp_path, tok_dir, train_type=train_type, kl_coef=0.1,
                                    rewards=["tests.train.rl_user_code:varied_reward"]), base_dir)
    loop = OnlineLoop(load_config(config, ["--max_steps", "2"]))
    assert isinstance(loop.objective.reference, AdapterDisabled)
    assert any(isinstance(m, LoraLinear) for m in loop.raw_model.modules())  # the engine runs the LoRA module
    adapters = {n: p.detach().clone() for n, p in loop.raw_model.named_parameters() if p.requires_grad}
    loop.train()
    assert loop.ctx.step == 2
    assert any(not torch.equal(p, adapters[n]) for n, p in loop.raw_model.named_parameters() if n in adapters)
    # step 2's rollout came from trained adapters: the engine ran the LoRA module as training does
    assert all(m["sampler_logp_diff"] < 1e-4 for m in read_metrics(tmp_path) if "sampler_logp_diff" in m)
    assert sum("sampler_logp_diff" in m for m in read_metrics(tmp_path)) == 2
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert (ckpt / ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").exists()
    if train_type == "online_ppo":
        value = torch.load(ckpt / "value_model.pt", weights_only=True)
        assert value and all(k.endswith(("lora_A", "lora_B")) or k.startswith("value_head") for k in value)


def test_generate_with_lora_equals_the_merged_model(tmp_path, tok_dir, base_dir, capsys):
    config = lora_run(write_run(tmp_path, tok_dir, "sft", max_steps=2), base_dir)
    config.write_text(config.read_text().replace("max_lr: 0.003", "max_lr: 0.05"))
    assert astrai_main(["train", "--config", str(config)]) == 0
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert astrai_main(["lora", "merge", "--adapter", str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    flags = ["--prompt", "12 + 34 =", "--temperature", "0", "--max_tokens", "8", "--device", "cpu"]
    outs = []
    for model_flags in (["--model", str(base_dir), "--lora", str(ckpt)], ["--model", str(tmp_path / "merged")],
                        ["--model", str(base_dir)]):
        assert astrai_main(["generate", *model_flags, *flags]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    # what --lora loads is the merged model, not the base
    from astrai.infer.engine import LLMEngine

    engine = LLMEngine.from_pretrained(base_dir, lora=str(ckpt), device="cpu", kv_cache_tokens=64)
    merged, base = load_model(tmp_path / "merged").state_dict(), load_model(base_dir).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(engine.model.state_dict()[q], merged[q]) and not torch.equal(merged[q], base[q])


@pytest.mark.slow
def test_lora_sigterm_resume_is_exact(tmp_path, tok_dir, base_dir, monkeypatch):
    flags = {"grad_accum_steps": 2, "batch_per_device": 2}
    straight = lora_run(write_run(tmp_path / "straight", tok_dir, "sft", **flags), base_dir, lora_dropout=0.1)
    stopped = lora_run(write_run(tmp_path / "stopped", tok_dir, "sft", **flags), base_dir, lora_dropout=0.1)
    assert train_in_process(straight, monkeypatch=monkeypatch) == 0
    assert train_in_process(stopped, kill_at=6, monkeypatch=monkeypatch) == 0
    assert latest_checkpoint(tmp_path / "stopped" / "ckpt").name == "step_00000003"
    assert train_in_process(stopped, "--resume", monkeypatch=monkeypatch) == 0
    keys = ("step", "epoch", "lr", "loss", "grad_norm")
    got = [{k: m[k] for k in keys} for m in read_metrics(tmp_path / "stopped")]
    assert got == [{k: m[k] for k in keys} for m in read_metrics(tmp_path / "straight")]
    a = load_file(str(latest_checkpoint(tmp_path / "straight" / "ckpt") / ADAPTER_WEIGHTS))
    b = load_file(str(latest_checkpoint(tmp_path / "stopped" / "ckpt") / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_online_rl_runs_lora_without_dropout_so_a_fresh_rollout_has_ratio_one(tmp_path, tok_dir, base_dir):
    """The engine samples in eval mode (no dropout); the trainer's forward drops nothing either
    (TRL's disable_dropout), so with lora_dropout 0.5 the fresh rollout's log-probs still match
    and the adapter config keeps the configured dropout."""
    import json

    config = lora_run(write_rl_run(tmp_path, tok_dir, rewards=["tests.train.rl_user_code:varied_reward"]),
                      base_dir, lora_dropout=0.5)
    assert astrai_main(["train", "--config", str(config), "--max_steps", "2"]) == 0
    fresh = [m["sampler_logp_diff"] for m in read_metrics(tmp_path) if "sampler_logp_diff" in m]
    assert len(fresh) == 2 and max(fresh) < 1e-5  # with dropout on in training: 5.6e-3 here
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert json.loads((ckpt / "adapter_config.json").read_text())["lora_dropout"] == 0.5


def test_a_lora_checkpoint_is_a_model_for_every_command_and_the_summary_says_how(tmp_path, tok_dir, base_dir,
                                                                                capsys):
    """`--model ADAPTER_DIR` (a LoRA run's checkpoint) finds its base from adapter_config.json in
    generate, chat, eval and serve, and the end-of-run "serve it" line is a command that works."""
    import shlex

    from astrai.serve.cli import _check_args, build_parser
    from astrai.serve.state import ServeConfig, load_engine

    config = lora_run(write_run(tmp_path, tok_dir, "sft", max_steps=2), base_dir)
    assert astrai_main(["train", "--config", str(config)]) == 0
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    serve_line = next(line for line in capsys.readouterr().err.splitlines() if "serve it:" in line)
    words = shlex.split(serve_line.split("serve it:", 1)[1])
    assert words[:2] == ["astrai", "serve"]
    flags = ["--prompt", "12 + 34 =", "--temperature", "0", "--max_tokens", "6", "--device", "cpu"]
    assert astrai_main(["generate", "--model", str(ckpt), *flags]) == 0
    by_adapter = capsys.readouterr().out
    assert astrai_main(["generate", "--model", str(base_dir), "--lora", str(ckpt), *flags]) == 0
    assert capsys.readouterr().out == by_adapter  # the same model: base + this adapter
    import io

    from astrai.infer.chat import main as chat_main

    out = io.StringIO()
    assert chat_main(["--model", str(ckpt), "--max_tokens", "4", "--device", "cpu", "--temperature", "0"],
                     stdin=io.StringIO("1 + 2\n/exit\n"), stdout=out) == 0
    records = tmp_path / "eval.jsonl"
    records.write_text(json.dumps({"messages": [{"role": "user", "content": "1 + 2"}], "answer": "3"}) + "\n")
    assert astrai_main(["eval", "--model", str(ckpt), "--data", str(records), "--max_tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["num_total"] == 1
    # serve: the summary's own command line parses and loads the adapter on its base
    args = build_parser().parse_args(words[2:])
    assert _check_args(args) is None  # what `astrai serve` checks before it starts
    assert (args.model, args.lora) == (str(base_dir.resolve()), str(ckpt)) and args.served_model_name == ckpt.name
    engine, _ = load_engine(ServeConfig(args.model, engine_kwargs={"lora": args.lora,
                                                                    "device": "cpu", "kv_cache_tokens": 256}))
    merged = load_model(ckpt).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(engine.model.state_dict()[q], merged[q])
