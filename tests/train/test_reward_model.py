"""Reward-model training (`train_type: reward`): held-out pair accuracy rises far above chance,
and a checkpoint is a transformers sequence-classification directory with the same scores, read
as it is by `rewards: [DIR]` and `critic_model_path`; under LoRA, a PEFT SEQ_CLS adapter that
PEFT, `rewards: [DIR]` and `astrai lora merge` read with the same scores."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from astrai.config import RLConfig
from astrai.config_values import ConfigError
from astrai.data.tokenizer import load_tokenizer
from astrai.model.classifier import SequenceClassifier, load_classifier
from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.lora_merge import main as lora_merge_main
from astrai.model.transformer import CausalLM
from astrai.model.value import ValueModel
from astrai.train.publish import latest_checkpoint
from astrai.train.rl.rewards import RewardSet
from astrai.train.trainer import Trainer
from tests.train.resume_data import MODEL, read_metrics, train_in_process, write_run
from tests.train.toydata import ToyPairDataset
from tests.train.trainer_utils import tiny_config, tiny_model, without_checkpoints


def test_reward_model_separates_held_out_pairs(tmp_path):
    # measured: val/accuracy 1.0 after 6 steps for seeds 0-3 on 1 and 2 threads (first step's
    # train accuracy 0.38-0.63); 0.9 leaves room for another machine's path
    cfg = tiny_config(tmp_path, "--max_lr", "3e-3", "--train_type", "reward", "--batch_per_device", "16",
                      "--max_steps", "6")
    t = Trainer(cfg, model=SequenceClassifier(tiny_model().config), train_dataset=ToyPairDataset(64),
                val_dataset=ToyPairDataset(64, seed=100))
    without_checkpoints(t)
    t.train()
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in lines if "val/accuracy" in x][-1]
    assert val["val/accuracy"] >= 0.9 and val["val/margin"] > 0.5, val
    train = [x for x in lines if x["split"] == "train"]
    assert "accuracy" in train[0] and "margin" in train[0]


def test_margin_column_enters_the_loss(tmp_path):
    cfg = tiny_config(tmp_path, "--train_type", "reward")
    t = Trainer(cfg, model=SequenceClassifier(tiny_model().config), train_dataset=ToyPairDataset(8))
    ds = ToyPairDataset(8)
    batch = ds.collate([ds[i] for i in range(4)])
    plain = t.objective(t.raw_model, batch).loss.detach()
    margin = t.objective(t.raw_model, {**batch, "margin": torch.full((4,), 2.0)}).loss.detach()
    assert float(margin) > float(plain)


def test_margin_column_is_read_from_preference_records(tmp_path, tok_dir):
    from astrai.data.datasets import build_dataset
    from astrai.data.records import RecordError, encode_record

    tok = load_tokenizer(tok_dir)
    pair = {"prompt": "1+1", "chosen": "2", "rejected": "3"}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({**pair, "margin": 1.5}) + "\n" + json.dumps(pair) + "\n")
    ds = build_dataset("dpo", path, tok, 64)
    assert ds.collate([ds[0], ds[1]])["margin"].tolist() == [1.5, 0.0]
    with pytest.raises(RecordError, match="field 'margin' must be a finite number"):
        encode_record({**pair, "margin": "big"}, "dpo", tok, 64)


def test_checkpoint_is_a_transformers_sequence_classifier(tmp_path, tok_dir, monkeypatch):
    transformers = pytest.importorskip("transformers")
    run = write_run(tmp_path / "rm", tok_dir, "reward", num_records=16, n_epoch=1)
    assert train_in_process(run, monkeypatch=monkeypatch) == 0
    assert "accuracy" in read_metrics(tmp_path / "rm")[-1]
    ckpt = latest_checkpoint(tmp_path / "rm" / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and len(config["id2label"]) == 1

    tok = load_tokenizer(tok_dir)
    chat = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    rows = [tok.apply_chat_template(chat), tok.encode("3+4=7"), tok.encode("20-5=15 and more")]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(ckpt).eval()
    with torch.no_grad():
        theirs = [float(hf(torch.tensor([r])).logits[0, 0]) for r in rows]
    ours = load_classifier(ckpt).eval()
    with torch.no_grad():
        mine = [float(ours(torch.tensor([r]))[0, -1]) for r in rows]
    assert mine == pytest.approx(theirs, abs=1e-4)

    # rewards: [DIR] scores the last token of prompt + completion as these are
    reward_set = RewardSet(RLConfig(rewards=[str(ckpt)]), tokenizer=tok)
    total, _ = reward_set(["p"] * 3, ["c"] * 3, [{}] * 3, rows, 1)
    assert total.tolist() == pytest.approx(theirs, abs=1e-4)
    # a reward run's ckpt_dir stands for its newest checkpoint, as param_path does
    by_dir, _ = RewardSet(RLConfig(rewards=[str(tmp_path / "rm" / "ckpt")]), tokenizer=tok)(
        ["p"] * 3, ["c"] * 3, [{}] * 3, rows, 1)
    assert torch.equal(by_dir, total)
    # critic_model_path: the same head, a value at every token
    critic = ValueModel.from_pretrained(tmp_path / "rm" / "ckpt")
    with torch.no_grad():
        assert float(critic(torch.tensor([rows[0]]))[0, -1]) == pytest.approx(theirs[0], abs=1e-4)

    # a further run starts from the reward model directory itself, keeping its head
    again = load_classifier(ckpt, seed=7)
    assert torch.equal(again.score.weight, ours.score.weight)


def lora_reward_run(run_dir, tok_dir, **train):
    """A LoRA `train_type: reward` run on a causal LM base (an SFT model's stand-in) in run_dir;
    returns (its config, the base directory)."""
    base = run_dir.parent / "sft"
    if not base.is_dir():
        save_model(CausalLM(ModelConfig(**MODEL), seed=0), base, tokenizer=load_tokenizer(tok_dir))
    config = write_run(run_dir, tok_dir, "reward", num_records=16, **train)
    cfg = yaml.safe_load(config.read_text())
    del cfg["model"]
    cfg["train"]["param_path"] = str(base)
    cfg["lora"] = {"lora_r": 4, "lora_alpha": 8.0}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config, base


def test_lora_reward_model_is_a_peft_seq_cls_adapter_with_the_same_scores(tmp_path, tok_dir, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    tok = load_tokenizer(tok_dir)
    run, base = lora_reward_run(tmp_path / "rm", tok_dir, max_steps=3)
    assert train_in_process(run, "--lora_targets", "q,v", monkeypatch=monkeypatch) == 0
    # the adapters (2 layers x r=4 x (q: 32 + 32, v: 32 + 16)) and the whole score head train
    assert f"trainable parameters: {2 * 4 * (64 + 48) + 32:,} of " in capsys.readouterr().err
    ckpt = latest_checkpoint(tmp_path / "rm" / "ckpt")
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]
    assert not (ckpt / "model.safetensors").exists()  # never a copy of the base
    ours = load_classifier(ckpt).eval()
    assert not torch.equal(ours.score.weight, load_classifier(base).score.weight)  # the head trained

    chat = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    rows = [tok.apply_chat_template(chat), tok.encode("3+4=7"), tok.encode("20-5=15 and more")]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    hf = peft.PeftModel.from_pretrained(hf, ckpt).eval()
    with torch.no_grad():
        theirs = [float(hf(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]
        mine = [float(ours(torch.tensor([r]))[0, -1]) for r in rows]
    assert mine == pytest.approx(theirs, abs=1e-4)
    # transformers' own PEFT integration reads the adapter directory as it is (num_labels: the base is a causal LM's)
    direct = transformers.AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=1).eval()
    with torch.no_grad():
        assert float(direct(input_ids=torch.tensor([rows[2]])).logits[0, 0]) == pytest.approx(theirs[2], abs=1e-4)
    # rewards: [DIR] and critic_model_path read the adapter (or the run's ckpt_dir) on its base
    total, _ = RewardSet(RLConfig(rewards=[str(tmp_path / "rm" / "ckpt")]), tokenizer=tok)(
        ["p"] * 3, ["c"] * 3, [{}] * 3, rows, 1)
    assert total.tolist() == pytest.approx(theirs, abs=1e-4)
    critic = ValueModel.from_pretrained(ckpt)
    with torch.no_grad():
        assert float(critic(torch.tensor([rows[1]]))[0, -1]) == pytest.approx(theirs[1], abs=1e-4)
    # `astrai lora merge` writes a plain sequence-classification directory that transformers loads
    assert lora_merge_main(["merge", "--adapter", str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert float(merged(input_ids=torch.tensor([rows[0]])).logits[0, 0]) == pytest.approx(theirs[0], abs=1e-4)
    with pytest.raises(ValueError, match="sequence-classification .reward model. adapter"):
        load_model(ckpt)  # a causal LM has no score head to load it into


def test_lora_reward_run_resumes_exactly(tmp_path, tok_dir, monkeypatch):
    flags = ("--max_steps", "4", "--ckpt_interval", "2")
    full, _ = lora_reward_run(tmp_path / "full", tok_dir)
    assert train_in_process(full, *flags, monkeypatch=monkeypatch) == 0
    stopped, _ = lora_reward_run(tmp_path / "stopped", tok_dir)
    assert train_in_process(stopped, *flags, "--max_steps", "2", monkeypatch=monkeypatch) == 0
    assert train_in_process(stopped, *flags, "--resume", monkeypatch=monkeypatch) == 0
    want, got = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "stopped")
    assert len(want) == 4 and [m["loss"] for m in got] == [m["loss"] for m in want]
    a, b = (load_classifier(latest_checkpoint(tmp_path / d / "ckpt")) for d in ("full", "stopped"))
    assert torch.equal(a.score.weight, b.score.weight)


def test_a_finished_rollout_is_scored_where_the_reward_model_was_trained(tmp_path, tok_dir):
    """Training rows are rendered conversations, whose last token is the template's newline after
    <|im_end|>; a rollout that stopped ends at <|im_end|>, so the newline is appended before scoring
    (scored at <|im_end|> itself, the model read a position it was never trained at)."""
    from astrai.model.classifier import save_classifier

    tok = load_tokenizer(tok_dir)
    model = SequenceClassifier(ModelConfig(**MODEL), seed=3)
    save_classifier(model, tmp_path / "rm", tokenizer=tok)
    chat = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    rendered = tok.apply_chat_template(chat)  # what train_type reward reads (the dpo record form)
    prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True)
    stopped = prompt + tok.encode("42") + [tok.stop_token_ids[-1]]  # a rollout that sampled <|im_end|>
    assert rendered[:len(stopped)] == stopped and len(rendered) == len(stopped) + 1
    truncated = prompt + tok.encode("42")  # no stop token: scored where it ends
    total, _ = RewardSet(RLConfig(rewards=[str(tmp_path / "rm")]), tokenizer=tok)(
        ["p"] * 2, ["42"] * 2, [{}] * 2, [stopped, truncated], 1)
    with torch.no_grad():
        want = [float(model(torch.tensor([rendered]))[0, -1]), float(model(torch.tensor([truncated]))[0, -1])]
        at_stop = float(model(torch.tensor([stopped]))[0, -1])
    assert total.tolist() == pytest.approx(want, abs=1e-5) and abs(at_stop - want[0]) > 1e-4


def test_reward_refuses_generation_eval(tmp_path):
    with pytest.raises(ConfigError, match="--val_data_path"):
        tiny_config(tmp_path, "--train_type", "reward", "--eval_data_path", "x.jsonl")


def test_the_run_summary_says_how_to_use_a_reward_model(tmp_path, tok_dir, monkeypatch, capsys):
    run = write_run(tmp_path / "rm", tok_dir, "reward", num_records=8, n_epoch=1)
    assert train_in_process(run, monkeypatch=monkeypatch) == 0
    err = capsys.readouterr().err
    assert "use it:    --rewards" in err and "serve it" not in err
