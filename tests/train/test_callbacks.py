"""Built-in callbacks: metrics log lines (train + validation), resume truncation, early stopping, and
the progress lines without a bar (every tenth of the run, after a silent minute, rank 0 only)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from astrai.train.callbacks import EarlyStopping, MetricsLogger
from astrai.train.context import TrainContext
from astrai.train.trainer import Trainer
from tests.train.toydata import ToySeqDataset
from tests.train.trainer_utils import tiny_config, tiny_model, without_checkpoints


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_metrics_lines_and_validation(tmp_path):
    cfg = tiny_config(tmp_path, "--batch_per_device", "4", "--max_steps", "4", "--val_interval", "2")
    t = Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(16), val_dataset=ToySeqDataset(8, seed=1))
    without_checkpoints(t)
    t.train()
    lines = read(tmp_path / "log" / "metrics.jsonl")
    train = [x for x in lines if x["split"] == "train"]
    val = [x for x in lines if x["split"] == "val"]
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    for key in ("step", "epoch", "lr", "loss", "grad_norm", "tokens_per_s"):
        assert key in train[0]
    assert [x["step"] for x in val] == [2, 4]
    assert val[0]["val/loss"] > 0


def test_val_split_holds_out_rows(tmp_path, monkeypatch):
    import astrai.data.datasets as datasets
    from astrai.train.build import build_datasets

    monkeypatch.setattr(datasets, "build_dataset", lambda *a, **k: ToySeqDataset(16))
    (tmp_path / "d.jsonl").write_text("{}\n")
    cfg = tiny_config(tmp_path, "--val_split", "0.25", "--data_path", str(tmp_path / "d.jsonl"))
    train, val = build_datasets(cfg, tokenizer=object())
    assert (len(train), len(val)) == (12, 4)
    assert not set(train.indices) & set(val.indices)
    assert train.collate is not None and val[0] == ToySeqDataset(16)[val.indices[0]]
    again = build_datasets(cfg, tokenizer=object())[1]
    assert again.indices == val.indices  # seeded: the same rows every run (and on resume)


class FakeTrainer:
    def __init__(self, step):
        self.ctx = TrainContext(step=step)
        self.is_main = True
        self.step_metrics = {}


def test_metrics_log_truncates_lines_after_resumed_step(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"split": "train", "step": s}) + "\n" for s in range(1, 6)))
    MetricsLogger(tmp_path).on_train_begin(FakeTrainer(step=3))
    assert [x["step"] for x in read(log)] == [1, 2, 3]
    MetricsLogger(tmp_path).on_train_begin(FakeTrainer(step=0))
    assert log.read_text() == ""


def test_early_stopping_patience_and_state():
    es = EarlyStopping("val/loss", patience=2, min_delta=0.01, mode="min")
    t = FakeTrainer(step=1)
    for value in (1.0, 0.995, 0.999):  # best 1.0; then two evaluations without a 0.01 gain
        t.step_metrics = {"val/loss": value}
        es.after_optimizer_step(t)
    assert t.ctx.stop_requested and "val/loss" in t.ctx.stop_reason
    restored = EarlyStopping("val/loss", patience=2)
    restored.load_state_dict(json.loads(json.dumps(es.state_dict())))
    assert restored.best == 1.0 and restored.num_bad == 2
    t2 = FakeTrainer(step=1)
    t2.step_metrics = {"loss": 3.0}  # no evaluation this step: nothing changes
    es2 = EarlyStopping("val/loss", patience=1)
    es2.after_optimizer_step(t2)
    assert not t2.ctx.stop_requested and es2.best is None


def test_early_stopping_stops_training(tmp_path):
    cfg = tiny_config(tmp_path, "--batch_per_device", "4", "--n_epoch", "20", "--val_interval", "1",
                      "--early_stopping_metric", "val/loss", "--early_stopping_patience", "1",
                      "--early_stopping_min_delta", "100")
    t = Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(8), val_dataset=ToySeqDataset(4, seed=1))
    without_checkpoints(t)
    t.train()
    assert t.ctx.step == 2 and t.ctx.stop_reason.startswith("early stopping")


def test_background_checkpoints_are_complete_when_training_returns(tmp_path):
    from astrai.train.publish import latest_checkpoint, verify_checkpoint

    cfg = tiny_config(tmp_path, "--batch_per_device", "4", "--max_steps", "4", "--ckpt_interval", "2",
                      "--ckpt_background", "true", "--keep_last", "5")
    Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(16)).train()
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["step_00000002", "step_00000004"]  # no hidden staging dir left behind
    for name in saved:
        verify_checkpoint(tmp_path / "ckpt" / name)
    assert latest_checkpoint(tmp_path / "ckpt").name == "step_00000004"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _loop(step: int = 0, is_main: bool = True, **metrics: float) -> SimpleNamespace:
    return SimpleNamespace(is_main=is_main, ctx=SimpleNamespace(step=step), step_metrics=metrics)


def test_progress_lines_every_tenth_of_the_run_and_after_a_silent_minute(capsys):
    from astrai.train.callbacks import ProgressBar

    clock = FakeClock()
    bar = ProgressBar(100, bar=False, clock=clock)
    loop = _loop(0, loss=1.0, lr=1e-3, tokens_per_s=4912.0)
    bar.on_train_begin(loop)
    for step in range(1, 101):
        clock.now += 1.0 if step != 55 else 61.0  # one slow step: a line although 55 is no tenth
        loop.ctx.step = step
        bar.after_optimizer_step(loop)
    lines = capsys.readouterr().err.splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [10, 20, 30, 40, 50, 55, 60, 70, 80, 90, 100]
    assert lines[0] == "step 10/100 (10%): loss 1.0000, 4,912 tok/s, 0:10 elapsed, eta 1:30"


def test_progress_lines_show_the_reward_and_only_rank_0_prints(capsys):
    from astrai.train.callbacks import ProgressBar

    bar = ProgressBar(4, bar=False, clock=FakeClock())
    for rank0 in (False, True):
        loop = _loop(0, is_main=rank0, loss=0.5, lr=1e-4, reward_mean=0.516, rollout_tokens_per_s=900.0)
        bar.on_train_begin(loop)
        loop.ctx.step = 4
        bar.after_optimizer_step(loop)
    assert capsys.readouterr().err.splitlines() == [
        "step 4/4 (100%): loss 0.5000, reward 0.516, 900 rollout tok/s, 0:00 elapsed"]


def same_score(prompt, completion, record):
    """A reward that cannot tell samples apart (as a verifier that parses no answer scores 0)."""
    return 0.0


def test_rollouts_without_signal_for_long_are_one_warning_naming_the_rewards(tmp_path, capsys):
    from astrai.train.callbacks import FLAT_REWARD_ROLLOUTS
    from astrai.train.cli import main
    from tests.train.resume_data import write_tokenizer
    from tests.train.rl_runs import write_rl_run

    reward = "tests.train.test_callbacks:same_score"
    config = write_rl_run(tmp_path, write_tokenizer(tmp_path / "tok"), rewards=[reward], rollout_max_tokens=2)
    assert main(["--config", str(config), "--max_steps", str(2 * FLAT_REWARD_ROLLOUTS + 1)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "frac_reward_zero_std 1.0" in line]
    assert len(warnings) == 1, warnings  # once per streak, however long it lasts
    assert warnings[0].startswith(
        f"warning: the last {FLAT_REWARD_ROLLOUTS} rollouts (steps 1-{FLAT_REWARD_ROLLOUTS}) had no prompt whose samples "
        "got different rewards (frac_reward_zero_std 1.0), so every advantage was 0 and the policy did not learn; "
        f"check that the rewards ({reward}) tell a prompt's samples apart")
    assert warnings[0].endswith("or raise --group_size / --rollout_temperature for more varied samples")


def test_a_rollout_with_signal_ends_the_streak():
    from types import SimpleNamespace

    from astrai.train.callbacks import FlatRewardsWarning

    watch = FlatRewardsWarning(["exact_match"], rollouts=2)
    loop = SimpleNamespace(ctx=SimpleNamespace(step=0), is_main=False, step_metrics={})
    for step, flat in enumerate([1.0, None, 0.5, 1.0, None, 1.0, 1.0, 1.0], 1):  # None: a reused rollout
        loop.ctx.step, loop.step_metrics = step, {} if flat is None else {"frac_reward_zero_std": flat}
        watch.after_optimizer_step(loop)
    assert [w.split(")")[0] for w in watch.warnings] == ["warning: the last 2 rollouts (steps 4-6"]
