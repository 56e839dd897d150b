"""Trainer loop: hook order, micro-batch invariance of the gradient, grad_norm is the pre-clip norm,
windows spanning epochs, stop requests at batch boundaries."""

from __future__ import annotations

import json
import math

import pytest
import torch

from astrai.train.trainer import Trainer
from tests.train.toydata import ToySeqDataset
from tests.train.trainer_utils import tiny_config, tiny_model, without_checkpoints


class Recorder:
    def __init__(self):
        self.events = []

    def on_train_begin(self, t):
        self.events.append("train_begin")

    def on_epoch_begin(self, t):
        self.events.append("epoch_begin")

    def on_batch_begin(self, t, batch):
        self.events.append("batch_begin")

    def on_batch_end(self, t, batch, out):
        self.events.append("batch_end")

    def before_optimizer_step(self, t):
        self.events.append("before_step")

    def after_optimizer_step(self, t):
        self.events.append("after_step")

    def on_epoch_end(self, t):
        self.events.append("epoch_end")

    def on_error(self, t, e):
        self.events.append("error")

    def on_train_end(self, t):
        self.events.append("train_end")


def make_trainer(tmp_path, dataset, *flags, callbacks=(), model=None):
    cfg = tiny_config(tmp_path, *flags)
    t = Trainer(cfg, model=model or tiny_model(), train_dataset=dataset, callbacks=list(callbacks))
    without_checkpoints(t)
    return t


def test_hooks_fire_in_order(tmp_path):
    rec = Recorder()
    t = make_trainer(tmp_path, ToySeqDataset(8), "--batch_per_device", "2", "--grad_accum_steps", "2",
                     "--n_epoch", "2", callbacks=[rec])
    t.train()
    window = ["batch_begin", "batch_end", "batch_begin", "batch_end", "before_step", "after_step"]
    epoch = ["epoch_begin", *window, *window, "epoch_end"]
    assert rec.events == ["train_begin", *epoch, *epoch, "train_end"]
    assert t.ctx.step == 4 and t.ctx.epoch == 2


def test_error_hook_then_train_end(tmp_path):
    rec = Recorder()

    class Boom:
        def on_batch_end(self, t, batch, out):
            raise RuntimeError("boom")

    t = make_trainer(tmp_path, ToySeqDataset(8), "--batch_per_device", "4", callbacks=[rec, Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        t.train()
    assert rec.events[-2:] == ["error", "train_end"]


def grads_after_one_step(tmp_path, batch_per_device, accum):
    captured = {}

    class Capture:
        def before_optimizer_step(self, t):
            captured.update({n: p.grad.clone() for n, p in t.raw_model.named_parameters()})
            captured["_norm"] = torch.nn.utils.get_total_norm([p.grad for p in t.raw_model.parameters()])

    t = make_trainer(tmp_path / f"{batch_per_device}x{accum}", ToySeqDataset(16),
                     "--batch_per_device", str(batch_per_device), "--grad_accum_steps", str(accum),
                     "--max_steps", "1", "--max_grad_norm", "0", callbacks=[Capture()])
    t.train()
    return captured, t


def test_gradient_is_independent_of_micro_batching(tmp_path):
    ref, _ = grads_after_one_step(tmp_path, 16, 1)
    for bs, accum in ((4, 4), (1, 16)):
        got, _ = grads_after_one_step(tmp_path, bs, accum)
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=f"{bs}x{accum}: {name}")


def test_logged_grad_norm_is_pre_clip_norm(tmp_path):
    seen = {}

    class Capture:
        def on_batch_end(self, t, batch, out):
            pass

        def before_optimizer_step(self, t):
            seen.setdefault("post_clip", []).append(
                float(torch.nn.utils.get_total_norm([p.grad for p in t.raw_model.parameters()])))

    t = make_trainer(tmp_path, ToySeqDataset(16), "--batch_per_device", "4", "--max_steps", "3",
                     "--max_grad_norm", "0.01", callbacks=[Capture()])
    unclipped, _ = grads_after_one_step(tmp_path / "unclipped", 4, 1)
    t.train()
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    # step 1 starts from the same weights and data as the unclipped run: same pre-clip norm
    assert lines[0]["grad_norm"] == pytest.approx(float(unclipped["_norm"]), rel=1e-5)
    for line, post in zip(lines, seen["post_clip"]):
        assert line["grad_norm"] > 0.01 * 5  # well above the clip threshold...
        assert post == pytest.approx(0.01, rel=1e-3)  # ...while the step used clipped gradients


def test_window_spans_epochs_and_tail_is_dropped(tmp_path):
    rec = Recorder()
    # 6 samples / batch 2 = 3 micro-batches per epoch; accum 2 -> windows cross epoch edges
    t = make_trainer(tmp_path, ToySeqDataset(6), "--batch_per_device", "2", "--grad_accum_steps", "2",
                     "--n_epoch", "3", callbacks=[rec])
    assert t.total_steps == 4  # 9 micro-batches -> 4 full windows, the last micro-batch is dropped
    t.train()
    assert t.ctx.step == 4
    ev = rec.events
    assert ev.count("epoch_begin") == 3 and ev.count("epoch_end") == 3
    first_step = ev.index("before_step")
    assert ev.index("epoch_end") < first_step or ev[:first_step].count("batch_end") == 2
    # the second window straddles the first epoch boundary
    second = ev.index("before_step", first_step + 1)
    assert "epoch_end" in ev[first_step:second] and "epoch_begin" in ev[first_step:second]


def test_stop_request_at_batch_boundary_drops_partial_window(tmp_path):
    class StopAfter:
        def __init__(self):
            self.batches = 0

        def on_batch_end(self, t, batch, out):
            self.batches += 1
            if self.batches == 5:  # inside the third window (accum 2)
                t.ctx.request_stop("test")

    t = make_trainer(tmp_path, ToySeqDataset(32), "--batch_per_device", "2", "--grad_accum_steps", "2",
                     callbacks=[StopAfter()])
    t.train()
    assert t.ctx.step == 2  # the third window was dropped
    assert t.ctx.consumed_samples == 8  # resume point: the start of the dropped window
    assert all(p.grad is None for p in t.raw_model.parameters())
    assert t.ctx.stop_reason == "test"


def test_resume_with_other_batch_size_is_reported(tmp_path, capsys):
    t = make_trainer(tmp_path, ToySeqDataset(16), "--batch_per_device", "4", "--max_steps", "1")
    t.train()
    state = t.state_dict()
    t2 = make_trainer(tmp_path / "b", ToySeqDataset(16), "--batch_per_device", "2", "--random_seed", "3")
    t2.load_state_dict(state)
    err = capsys.readouterr().err
    assert "batch_per_device=2" in err and "batch_per_device=4" in err and "random_seed=3" in err


def test_state_dict_is_json_and_round_trips(tmp_path):
    t = make_trainer(tmp_path, ToySeqDataset(16), "--batch_per_device", "4", "--max_steps", "2")
    t.train()
    state = json.loads(json.dumps(t.state_dict()))
    assert state["step"] == 2 and state["consumed_samples"] == 8 and state["world_size"] == 1
    t2 = make_trainer(tmp_path / "b", ToySeqDataset(16), "--batch_per_device", "4", "--max_steps", "4")
    torch.manual_seed(123)
    t2.load_state_dict(state)
    assert (t2.ctx.step, t2.ctx.consumed_samples, t2.ctx.epoch) == (2, 8, 0)
    assert torch.equal(torch.get_rng_state(), torch.tensor(state["rng"]["torch"], dtype=torch.uint8))


def test_gradient_checkpointing_same_gradients_and_bf16_runs(tmp_path):
    captured = {}

    class Capture:
        def before_optimizer_step(self, t):
            captured.update({n: p.grad.clone() for n, p in t.raw_model.named_parameters()})

    t = make_trainer(tmp_path / "gc", ToySeqDataset(16), "--batch_per_device", "8", "--max_steps", "1",
                     "--max_grad_norm", "0", "--gradient_checkpointing", callbacks=[Capture()])
    assert t.raw_model.gradient_checkpointing
    t.train()
    ref8, _ = grads_after_one_step(tmp_path / "plain8", 8, 1)
    for name, g in ref8.items():
        if name != "_norm":
            torch.testing.assert_close(captured[name], g, rtol=1e-5, atol=1e-7)
    t = make_trainer(tmp_path / "bf16", ToySeqDataset(16), "--batch_per_device", "8", "--max_steps", "2", "--bf16")
    t.train()
    line = json.loads((tmp_path / "bf16" / "log" / "metrics.jsonl").read_text().splitlines()[-1])
    assert math.isfinite(line["loss"]) and line["loss"] > 0
    assert all(p.dtype == torch.float32 for p in t.raw_model.parameters())  # fp32 master weights


def test_max_steps_overrides_n_epoch(tmp_path):
    t = make_trainer(tmp_path, ToySeqDataset(8), "--batch_per_device", "4", "--max_steps", "5", "--n_epoch", "1")
    t.train()
    assert t.ctx.step == 5 and t.ctx.epoch == 2  # 2 steps per epoch: the fifth is in the third epoch


def test_group_by_length_needs_dataset_lengths(tmp_path):
    cfg = tiny_config(tmp_path, "--group_by_length", "true", "--batch_per_device", "4", "--max_steps", "2")
    with pytest.raises(ValueError, match="group_by_length=true needs a dataset with a lengths"):
        Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(8))

    class WithLengths(ToySeqDataset):
        def lengths(self):
            return [len(ids) for ids, _ in self.rows]

    ds = WithLengths(64)
    t = Trainer(cfg, model=tiny_model(), train_dataset=ds)
    lengths = ds.lengths()
    order = t.sampler.global_order()
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)  # one mega-batch: fully sorted
