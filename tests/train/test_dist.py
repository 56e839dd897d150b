"""astrai.train.dist in one process: the same calls work without a process group (multi-rank: test_dist_train)."""

from __future__ import annotations

import pytest
import torch

from astrai.train import dist


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def test_init_without_environment_is_single_process():
    info = dist.init_distributed(device="cpu")
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, None)
    assert info.is_main and info.device == torch.device("cpu")
    assert not dist.is_distributed() and dist.get_rank() == 0 and dist.get_world_size() == 1


def test_world_size_without_master_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        dist.init_distributed(device="cpu")


def test_collectives_are_identities():
    t = torch.tensor([1.0, 2.0])
    assert dist.all_reduce_sum(t) is t
    assert dist.all_reduce_metrics({"a": 1.5}) == {"a": 1.5}
    assert dist.any_rank(True) and not dist.any_rank(False)
    assert dist.broadcast_object({"x": 1}) == {"x": 1}
    dist.barrier()
    dist.cleanup()


def test_wrap_model_modes():
    model = torch.nn.Linear(2, 2)
    one = dist.DistInfo(0, 1, 0, torch.device("cpu"), None)
    for mode in dist.PARALLEL_MODES:
        assert dist.wrap_model(model, mode, one) is model
    with pytest.raises(ValueError, match="parallel_mode 'zero3'"):
        dist.wrap_model(model, "zero3", one)
    two = dist.DistInfo(0, 2, 0, torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match="independent copies; use --parallel_mode ddp or fsdp"):
        dist.wrap_model(model, "none", two)
    assert dist.unwrap_model(model) is model and not dist.is_fsdp(model)
    with dist.no_sync(model, True):
        pass


def test_full_state_dicts_roundtrip_by_parameter_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    msd = dist.full_model_state_dict(model)
    osd = dist.full_optimizer_state_dict(model, opt)
    assert set(osd["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}  # names, not indices

    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    dist.load_full_model_state_dict(other, msd)
    dist.load_full_optimizer_state_dict(other, other_opt, osd)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert other_opt.param_groups[0]["lr"] == 0.1
    assert torch.equal(other_opt.state[other[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
