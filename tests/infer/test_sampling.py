"""Sampling: each knob of SamplingParams against a small per-row pure-PyTorch reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from astrai.infer.sampling import Sampler, SamplingParams, make_generator, process_logits

V = 50


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 2, 7])
    output_token_ids: list[int] = field(default_factory=lambda: [7, 7, 9, 3])
    generator: torch.Generator | None = None
    uniform_block: list[float] = field(default_factory=list)
    min_tokens_stop_ids: list[int] = field(default_factory=lambda: [0, 5])


def reference_logprobs(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """The distribution one row samples from, written out token by token."""
    p, x = row.params, logits.clone().float()
    for t in set(row.prompt_token_ids + row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        x[t] -= p.frequency_penalty * row.output_token_ids.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(row.output_token_ids) < p.min_tokens:
        x[row.min_tokens_stop_ids] = -math.inf
    if p.temperature == 0:
        return torch.log_softmax(x, -1)
    x = x / p.temperature
    if p.top_k:
        x[x < torch.topk(x, p.top_k).values[-1]] = -math.inf
    if p.top_p < 1:
        probs = torch.softmax(x, -1)
        order = probs.argsort(descending=True).tolist()
        kept, mass = [], 0.0
        for t in order:  # the smallest set of most likely tokens holding top_p of the mass
            kept.append(t)
            mass += probs[t].item()
            if mass >= p.top_p:
                break
        drop = torch.ones(V, dtype=torch.bool)
        drop[kept] = False
        x[drop] = -math.inf
    if p.min_p:
        probs = torch.softmax(x, -1)
        x[probs < p.min_p * probs.max()] = -math.inf
    return torch.log_softmax(x, -1)


KNOBS = [
    dict(temperature=0.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
    dict(frequency_penalty=0.5),
    dict(presence_penalty=-0.7),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, frequency_penalty=0.2, presence_penalty=0.3),
    dict(logit_bias={4: 5.0, 11: -100.0}),
    dict(min_tokens=6),
    dict(temperature=0.0, repetition_penalty=1.5, logit_bias={3: 2.0}, min_tokens=10),
]


def test_each_knob_matches_reference_in_one_mixed_batch():
    logits = torch.randn(len(KNOBS), V, generator=torch.Generator().manual_seed(0)) * 3
    rows = [Row(SamplingParams(**k)) for k in KNOBS]
    _, final = process_logits(logits, rows)
    got = torch.log_softmax(final, -1)
    for i, row in enumerate(rows):
        want = reference_logprobs(logits[i], row)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), KNOBS[i]
        finite = ~torch.isinf(want)
        assert torch.allclose(got[i][finite], want[finite], atol=1e-5), KNOBS[i]


def test_logprobs_follow_the_sampling_distribution_and_raw_model():
    logits = torch.randn(len(KNOBS), V, generator=torch.Generator().manual_seed(1)) * 3
    rows = [Row(SamplingParams(**k, logprobs=3)) for k in KNOBS]
    out = Sampler(make_generator(0)).sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i, (row, token) in enumerate(zip(rows, out.token_ids)):
        want = reference_logprobs(logits[i], row)
        assert out.logprobs[i].item() == pytest.approx(want[token].item(), abs=1e-5)
        assert out.raw_logprobs[i].item() == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert torch.allclose(out.top_logprobs[i], want.topk(3).values, atol=1e-5)
        assert out.ranks[i].item() == int((want > want[token]).sum()) + 1
        if row.params.greedy:
            assert token == int(want.argmax())


def test_greedy_logprob_equals_raw_without_penalties():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(4)]
    out = Sampler().sample(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert torch.equal(out.logprobs, out.raw_logprobs)


def test_samples_follow_the_truncated_distribution():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    rows = [Row(params) for _ in range(6000)]
    out = Sampler(make_generator(0)).sample(logits.expand(len(rows), V), rows)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=V).float() / len(rows)
    want = reference_logprobs(logits, rows[0]).exp()
    assert freq[want == 0].sum() == 0
    assert (freq - want).abs().max() < 0.025


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, seed=7)

    def draws(batch: torch.Tensor, row_index: int) -> list[int]:
        gens = [make_generator(7) if i == row_index else None for i in range(len(batch))]
        rows = [Row(params if gens[i] else SamplingParams(), generator=gens[i]) for i in range(len(batch))]
        sampler = Sampler(make_generator(123))
        return [sampler.sample(batch, rows).token_ids[row_index] for _ in range(20)]

    alone = draws(logits[1:2], 0)
    assert draws(logits, 1) == alone
    assert draws(logits[[2, 0, 1]], 2) == alone
    assert len(set(alone)) > 1  # it really samples


@pytest.mark.parametrize("bad, field_name", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(min_p=1.2), "min_p"), (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(n=0), "n"), (dict(logprobs=21), "logprobs"), (dict(logit_bias={1: 200.0}), "logit_bias"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed=1.5), "seed"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_params_name_the_field(bad, field_name):
    with pytest.raises(ValueError, match=field_name):
        SamplingParams(**bad)


def test_params_normalise_inputs():
    p = SamplingParams(stop="###", top_k=-1, logit_bias={"5": 1})
    assert p.stop == ["###"] and p.top_k == 0 and p.logit_bias == {5: 1.0}
    with pytest.raises(ValueError, match="vocabulary has 10"):
        SamplingParams(stop_token_ids=[12]).check_vocab(10)


def test_inverse_cdf_never_returns_an_empty_token_and_follows_the_distribution():
    from astrai.infer.sampling import inverse_cdf

    for V in (7, 256, 700):  # fewer than, exactly, and not a multiple of the chunk size
        probs = torch.rand(V, generator=torch.Generator().manual_seed(V)) ** 3
        probs[torch.arange(0, V, 3)] = 0.0  # every third token impossible, the last one too
        probs[-1] = 0.0
        if V == 700:
            probs[-300:] = 0.0  # the last chunk holds nothing
        probs = probs / probs.sum()
        # u * total can round up to the total itself: u = 1 stands for that case
        edges = torch.tensor([0.0, 1e-300, 0.5, 1 - 2**-53, 1.0], dtype=torch.float64)
        tokens = inverse_cdf(probs.expand(len(edges), V), edges)
        assert (probs[tokens] > 0).all(), V
        u = torch.rand(40000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        freq = torch.bincount(inverse_cdf(probs.expand(len(u), V), u), minlength=V).float() / len(u)
        assert freq[probs == 0].sum() == 0
        assert (freq - probs).abs().max() < 0.015, V


def test_top_p_past_the_candidate_tokens_sorts_the_whole_vocabulary():
    from astrai.model import logprobs

    big = 3 * logprobs.TOP_P_CANDIDATES  # flat logits: the top_p cutoff lies past the candidates
    logits = torch.randn(3, big, generator=torch.Generator().manual_seed(5)) * 0.1
    logits[2] *= 200  # a peaked row: its cutoff lies among the candidates
    top_k, top_p = torch.tensor([big, 20, big]), torch.tensor([0.9, 0.5, 0.9])

    def expected(i: int) -> torch.Tensor:
        x = logits[i].clone()
        if top_k[i] < big:
            x[x < x.topk(int(top_k[i])).values[-1]] = -math.inf
        probs = torch.softmax(x, -1)
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        keep = torch.zeros(big, dtype=torch.bool)
        keep[order[before < top_p[i]]] = True
        return keep

    for rows in ([0, 1, 2], [1, 2]):  # with the flat row (whole vocabulary sorted), without it
        got = logprobs.apply_truncation(logits[rows], top_k[rows], top_p[rows], torch.zeros(len(rows)))
        for j, i in enumerate(rows):
            keep = expected(i)
            assert 1 < int(keep.sum()) < big
            assert torch.equal(~torch.isinf(got[j]), keep), (rows, i)
            assert torch.equal(got[j][keep], logits[i][keep])


def test_a_seeded_row_draws_its_generator_stream_one_number_per_step():
    """Seeded rows take their uniform numbers in blocks from their own generator: the draw of
    step t is the t-th number of the seed's stream (on a CPU, one torch.rand per step), also
    across a block boundary and with rows coming and going around it."""
    from astrai.infer.sampling import UNIFORM_BLOCK, inverse_cdf

    steps = UNIFORM_BLOCK + 9
    logits = torch.randn(steps, V, generator=torch.Generator().manual_seed(6)) * 2
    stream = torch.rand(steps, dtype=torch.float64, generator=make_generator(11))
    want = [inverse_cdf((logits[t:t + 1] - logits[t].max()).exp(), stream[t:t + 1]).item()
            for t in range(steps)]
    sampler = Sampler(make_generator(0))
    row = Row(SamplingParams(temperature=1.0, seed=11), generator=make_generator(11))
    got = []
    for t in range(steps):
        others = [Row(SamplingParams(temperature=1.0), generator=make_generator(100 + t)) for _ in range(t % 3)]
        batch = torch.cat([logits[t:t + 1], torch.randn(len(others), V)])
        got.append(sampler.sample(batch, [row, *others]).token_ids[0])
    assert got == want
    assert len(set(got)) > 5  # it really samples


def test_a_seeded_rows_stream_lives_on_the_row_not_in_the_sampler():
    """The drawn-ahead block is the row's own: the sampler keeps nothing keyed by generator (a
    CUDA generator takes no weak reference, which broke every seeded GPU rollout once), and a
    finished row's generator is freed with it."""
    import gc
    import weakref

    from astrai.infer.sampling import UNIFORM_BLOCK

    sampler = Sampler(make_generator(0))
    row = Row(SamplingParams(temperature=1.0, seed=3), generator=make_generator(3))
    sampler.sample(torch.randn(1, V), [row])
    assert len(row.uniform_block) == UNIFORM_BLOCK - 1
    gone = weakref.ref(row.generator)
    del row
    gc.collect()
    assert gone() is None
