"""The training-state layer: save/load of model, optimizer, scheduler, state and extras, in one process."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.config import OptimConfig
from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM
from astrai.train import checkpoint as C
from astrai.train import publish as P
from astrai.train.optim import LRSchedule, build_optimizer


def _config(tied: bool = False) -> ModelConfig:
    return ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )


def _setup(seed: int = 0, tied: bool = False, optimizer: str = "adamw"):
    model = CausalLM(_config(tied), seed=seed)
    cfg = OptimConfig(optimizer=optimizer, max_lr=1e-2, weight_decay=0.1, schedule="cosine", warmup_steps=2)
    opt = build_optimizer(model, cfg)
    return model, opt, LRSchedule(opt, cfg, total_steps=10)


def _steps(model, opt, sched, n: int, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (2, 9), generator=g)
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _save(tmp_path, model, opt, sched, step, **kw):
    return C.save_training_checkpoint(
        tmp_path / "ckpt", step, model=model, tokenizer=None, optimizer=opt, scheduler=sched,
        trainer_state={"step": step, "epoch": 0}, **kw,
    )


@pytest.mark.parametrize("tied, optimizer", [(False, "adamw"), (True, "adamw"), (False, "muon")])
def test_save_load_continues_bit_for_bit(tmp_path, tied, optimizer):
    model, opt, sched = _setup(tied=tied, optimizer=optimizer)
    _steps(model, opt, sched, 3)
    path = _save(tmp_path, model, opt, sched, 3)
    straight = _steps(model, opt, sched, 3, start=3)

    model2, opt2, sched2 = _setup(seed=1, tied=tied, optimizer=optimizer)  # other init: all must come from disk
    state = C.load_training_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert state == {"step": 3, "epoch": 0}
    assert sched2.step_count == 3
    resumed = _steps(model2, opt2, sched2, 3, start=3)
    assert resumed == straight
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), name
    if tied:
        assert model2.lm_head.weight is model2.model.embed_tokens.weight


def test_checkpoint_is_a_model_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    import astrai

    model, opt, sched = _setup()
    path = _save(tmp_path, model, opt, sched, 1)
    names = set(P.read_manifest(path)["files"])
    assert {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= names
    ids = torch.randint(0, 64, (1, 8))
    expected = model(ids).logits
    torch.testing.assert_close(astrai.load_model(path)(ids).logits, expected)
    hf = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(hf(ids).logits, expected, atol=1e-5, rtol=1e-4)


def test_extras_metrics_and_retention(tmp_path):
    model, opt, sched = _setup()
    metrics = tmp_path / "log" / "metrics.jsonl"
    metrics.parent.mkdir()
    for step in (1, 2, 3):
        metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, step + 1)))
        path = _save(tmp_path, model, opt, sched, step, keep_last=2, metrics_path=metrics,
                     extra_state={"value_model": {"w": torch.full((2,), float(step))}})
    assert [s for s, _ in P.list_checkpoints(tmp_path / "ckpt")] == [2, 3]
    assert torch.equal(C.load_extra_state(path, "value_model")["w"], torch.full((2,), 3.0))
    # a later run wrote more lines; restoring the checkpoint's copy rewinds the log to step 2
    metrics.write_text(metrics.read_text() + json.dumps({"step": 4}) + "\n")
    C.load_training_checkpoint(tmp_path / "ckpt" / "step_00000002", model=model, optimizer=opt, scheduler=sched,
                               metrics_path=metrics)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_truncated_optimizer_is_an_error_naming_the_file(tmp_path):
    model, opt, sched = _setup()
    path = _save(tmp_path, model, opt, sched, 1)
    data = (path / "optimizer.pt").read_bytes()
    (path / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(P.CheckpointError, match="optimizer.pt"):
        C.load_training_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    # without checksums the size check still names it; without a manifest, torch.load does
    with pytest.raises(P.CheckpointError, match="optimizer.pt"):
        C.load_training_checkpoint(path, model=model, optimizer=opt, scheduler=sched, verify=False)
    (path / "manifest.json").unlink()
    with pytest.raises(P.CheckpointError, match="optimizer.pt.*cannot be loaded"):
        C.load_training_checkpoint(path, model=model, optimizer=opt, scheduler=sched)


def test_missing_scheduler_and_corrupt_weights_are_named(tmp_path):
    model, opt, sched = _setup()
    path = _save(tmp_path, model, opt, sched, 1)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte inside a tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(P.CheckpointError, match="model.safetensors.*sha256"):
        C.load_training_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    path = _save(tmp_path, model, opt, sched, 2)
    (path / "manifest.json").unlink()  # legacy directory: loads unverified when named
    C.load_training_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    (path / "scheduler.pt").unlink()
    with pytest.raises(P.CheckpointError, match="scheduler.pt is missing"):
        C.load_training_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    with pytest.raises(P.CheckpointError, match="does not exist"):
        C.load_training_checkpoint(tmp_path / "nope", model=model, optimizer=opt, scheduler=sched)


def test_trainer_state_must_be_json(tmp_path):
    model, opt, sched = _setup()
    with pytest.raises(TypeError, match="trainer_state must be JSON-serialisable"):
        C.save_training_checkpoint(tmp_path, 1, model=model, tokenizer=None, optimizer=opt, scheduler=sched,
                                   trainer_state={"t": torch.zeros(1)})
    assert P.latest_checkpoint(tmp_path) is None
