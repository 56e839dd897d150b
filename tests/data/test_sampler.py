"""ResumableSampler: deterministic order, exact resume, disjoint rank shards covering the data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.data.sampler import ResumableSampler


def test_deterministic_per_seed_and_epoch():
    a, b = ResumableSampler(50, seed=1), ResumableSampler(50, seed=1)
    first = list(a)
    assert first == list(b) and sorted(first) == list(range(50))
    assert list(a) == []  # the epoch is used up until set_epoch moves on
    assert first != list(ResumableSampler(50, seed=2))
    a.set_epoch(1)
    second = list(a)
    assert second != first and sorted(second) == list(range(50))
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(0, 60), seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_stop_after_k_and_resume_is_uninterrupted_order(n, k, seed, epoch):
    full = ResumableSampler(n, seed=seed)
    full.set_epoch(epoch)
    expected = list(full)
    k = min(k, n)
    run = ResumableSampler(n, seed=seed)
    run.set_epoch(epoch)
    it = iter(run)
    seen = [next(it) for _ in range(k)]
    state = run.state_dict()
    assert state["consumed_samples"] == k
    resumed = ResumableSampler(n, seed=seed)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # the trainer re-sets the epoch after loading; the position stays
    assert seen + list(resumed) == expected


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50), world=st.integers(1, 4), consumed_steps=st.integers(0, 5))
def test_ranks_disjoint_cover_and_resume(n, world, consumed_steps):
    samplers = [ResumableSampler(n, seed=3, rank=r, world_size=world) for r in range(world)]
    shards = [list(s) for s in samplers]
    assert len({len(s) for s in shards}) == 1  # equal counts keep DDP ranks in lockstep
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n))  # cover
    if n % world == 0:
        assert len(flat) == len(set(flat)) == n  # disjoint
    # interleaving the shards gives the global order; resume from a global count per rank
    order = samplers[0].global_order()
    consumed = min(consumed_steps * world, samplers[0].total_size)
    for r in range(world):
        s = ResumableSampler(n, seed=3, rank=r, world_size=world)
        s.set_consumed(consumed)
        assert list(s) == order[consumed + r::world]


def test_disjoint_with_drop_last():
    shards = [list(ResumableSampler(10, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 9


def test_errors():
    with pytest.raises(ValueError, match="dataset is empty"):
        ResumableSampler(0)
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        ResumableSampler(10, rank=2, world_size=2)
    s = ResumableSampler(10, seed=0)
    with pytest.raises(ValueError, match="num_samples=12 but this sampler has 10"):
        s.load_state_dict({**s.state_dict(), "num_samples": 12})
    with pytest.raises(ValueError, match="consumed_samples 11 is outside"):
        s.set_consumed(11)


def test_group_by_length_batches_similar_lengths_and_resumes():
    from astrai.data.sampler import GROUP_BATCHES

    g = torch.Generator().manual_seed(0)
    n, batch, world = 1000, 4, 2
    lengths = torch.randint(10, 500, (n,), generator=g).tolist()
    plain = ResumableSampler(n, seed=3, world_size=world, rank=0)
    grouped = ResumableSampler(n, seed=3, world_size=world, rank=0, lengths=lengths, group_size=batch * world)
    order = grouped.global_order()
    assert sorted(order) == sorted(plain.global_order())  # the same samples, only reordered
    mega = batch * world * GROUP_BATCHES
    first = order[:mega]
    assert [lengths[i] for i in first] == sorted((lengths[i] for i in first), reverse=True)
    assert set(first) == set(plain.global_order()[:mega])  # grouping never moves a sample across mega-batches

    def spread(o):  # mean (max - min) length within the global batches
        batches = [o[i:i + batch * world] for i in range(0, len(o), batch * world)]
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)

    assert spread(order) < 0.1 * spread(plain.global_order())
    # resumable: stop after 3 batches on every rank, resume in a fresh sampler
    ranks = [ResumableSampler(n, seed=3, world_size=world, rank=r, lengths=lengths, group_size=batch * world)
             for r in range(world)]
    full = [list(s) for s in ranks]
    resumed = []
    for r in range(world):
        s = ResumableSampler(n, seed=3, world_size=world, rank=r, lengths=lengths, group_size=batch * world)
        s.load_state_dict({**ranks[r].state_dict(), "consumed_samples": 3 * batch * world})
        resumed.append(list(s))
    assert [f[3 * batch:] for f in full] == resumed
    with pytest.raises(ValueError, match="group_by_length"):
        plain.load_state_dict(grouped.state_dict())
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        ResumableSampler(4, lengths=[1, 2, 3])
