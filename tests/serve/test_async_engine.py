"""The async engine loop with a fake engine: one engine thread, per-request queues, abort, failure."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from astrai.serve.async_engine import AsyncEngine, EngineDeadError
from astrai.serve.metrics import ServerMetrics


@dataclass
class _Seq:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: None = None

    @property
    def text(self) -> str:
        return "".join(f"<{t}>" for t in self.token_ids)


class FakeEngine:
    """One new token per sequence per step; remembers which thread called it."""

    max_model_len = 8

    def __init__(self, fail_at_step: int | None = None):
        self.requests: dict[str, tuple[list[_Seq], int]] = {}
        self.threads: set[str] = set()
        self.aborted: list[str] = []
        self.num_steps = 0
        self.fail_at_step = fail_at_step
        self.gate: threading.Event | None = None  # set: steps wait for it (a request held in flight)

    def add_request(self, rid, prompt_ids, params, with_logprobs=True):
        self.threads.add(threading.current_thread().name)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}")
        self.requests[rid] = ([_Seq(i) for i in range(params.n)], params.max_tokens)

    def abort(self, rid):
        self.threads.add(threading.current_thread().name)
        if self.requests.pop(rid, None) is not None:
            self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate (guard)"
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("boom")
        outs = []
        for rid, (seqs, max_tokens) in list(self.requests.items()):
            for s in seqs:
                s.token_ids.append(len(s.token_ids) + 10 * s.index)
                s.logprobs.append(-1.0)
                s.raw_logprobs.append(-2.0)
                if len(s.token_ids) >= max_tokens:
                    s.finish_reason = "length"
            finished = all(s.finish_reason for s in seqs)
            outs.append(SimpleNamespace(request_id=rid, outputs=[_copy(s) for s in seqs], finished=finished,
                                        num_cached_tokens=0))
            if finished:
                del self.requests[rid]
        return outs

    def stats(self):
        return SimpleNamespace(num_running=len(self.requests), num_waiting=0, kv_usage=0.5 * bool(self.requests))


def _copy(s: _Seq) -> _Seq:
    return _Seq(s.index, list(s.token_ids), list(s.logprobs), list(s.raw_logprobs), s.finish_reason)


def _params(n: int = 1, max_tokens: int = 3):
    return SimpleNamespace(n=n, max_tokens=max_tokens)


async def _drain(stream):
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons, lps = {}, {}
    async for batch in stream.batches():
        for update in batch:
            for seq in update.outputs:
                tokens.setdefault((update.request_id, seq.index), []).extend(seq.new_token_ids)
                lps.setdefault((update.request_id, seq.index), []).extend(seq.new_logprobs or [])
                if seq.finish_reason:
                    reasons[(update.request_id, seq.index)] = seq.finish_reason
    return tokens, reasons, lps


def test_outputs_reach_their_own_queues_from_one_engine_thread():
    async def main():
        engine = FakeEngine()
        loop_engine = AsyncEngine(engine, ServerMetrics("m"))
        loop_engine.start()
        streams = [await loop_engine.submit([(f"r{i}", [1, 2])], _params(n=2, max_tokens=3 + i), want_logprobs=True)
                   for i in range(3)]
        results = await asyncio.gather(*(_drain(s) for s in streams))
        await loop_engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    assert engine.threads == {"astrai-engine"}
    for i, (tokens, reasons, lps) in enumerate(results):
        assert tokens == {(f"r{i}", 0): list(range(3 + i)), (f"r{i}", 1): [10 + t for t in range(3 + i)]}
        assert set(reasons.values()) == {"length"} and len(reasons) == 2
        assert lps[(f"r{i}", 0)] == [-2.0] * (3 + i)  # raw logprobs are the ones served


def test_rejected_request_raises_and_others_keep_running():
    async def main():
        engine = FakeEngine()
        loop_engine = AsyncEngine(engine)
        loop_engine.start()
        good = await loop_engine.submit([("ok", [1])], _params(max_tokens=4))
        with pytest.raises(ValueError, match="max_model_len is 8"):
            # the second prompt is rejected, so the first of this group must not run either
            await loop_engine.submit([("a", [1]), ("b", list(range(9)))], _params())
        tokens, reasons, _ = await _drain(good)
        await loop_engine.shutdown()
        return engine, tokens, reasons

    engine, tokens, reasons = asyncio.run(main())
    assert tokens[("ok", 0)] == [0, 1, 2, 3] and reasons[("ok", 0)] == "length"
    assert engine.aborted == ["a"]


def test_abort_frees_the_request_and_shutdown_aborts_the_rest():
    async def main():
        engine = FakeEngine()
        metrics = ServerMetrics("m")
        loop_engine = AsyncEngine(engine, metrics)
        loop_engine.start()
        first = await loop_engine.submit([("x", [1])], _params(max_tokens=10**9))
        second = await loop_engine.submit([("y", [1])], _params(max_tokens=10**9))
        async for _ in first.batches():
            break
        loop_engine.abort(["x"])
        while "x" not in engine.aborted:
            await asyncio.sleep(0.01)
        await loop_engine.shutdown()
        _, reasons, _ = await _drain(second)
        return engine, reasons, metrics.render()[0]

    engine, reasons, text = asyncio.run(main())
    assert engine.aborted == ["x", "y"]
    assert reasons == {("y", 0): "abort"}
    assert 'astrai_request_success_total{finished_reason="abort",model_name="m"} 2.0' in text.decode()


def test_engine_failure_fails_running_requests_and_the_loop_survives():
    async def main():
        engine = FakeEngine(fail_at_step=2)
        loop_engine = AsyncEngine(engine)
        loop_engine.start()
        doomed = await loop_engine.submit([("d", [1])], _params(max_tokens=5))
        with pytest.raises(EngineDeadError, match="boom"):
            await _drain(doomed)
        after = await loop_engine.submit([("after", [1])], _params(max_tokens=2))
        tokens, _, _ = await _drain(after)
        await loop_engine.shutdown()
        return tokens

    assert asyncio.run(main())[("after", 0)] == [0, 1]


def test_submit_after_shutdown_is_refused():
    async def main():
        loop_engine = AsyncEngine(FakeEngine())
        loop_engine.start()
        await loop_engine.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await loop_engine.submit([("late", [1])], _params())

    asyncio.run(main())


def test_a_load_waits_for_the_requests_in_flight_and_holds_new_ones():
    async def main():
        engine = FakeEngine()
        engine.gate = threading.Event()  # "old" stays in flight until the load and "new" have come
        loop_engine = AsyncEngine(engine)
        loop_engine.start()
        first = await loop_engine.submit([("old", [1])], _params(max_tokens=5))
        seen = {}

        def load():  # on the engine thread, between steps
            seen.update(running=set(engine.requests), steps=engine.num_steps)
            return "loaded"

        loading = asyncio.ensure_future(loop_engine.run_between_steps(load))
        await asyncio.sleep(0)  # the load command is in the inbox before the next request's
        second = asyncio.ensure_future(loop_engine.submit([("new", [1])], _params(max_tokens=2)))
        await asyncio.sleep(0)
        engine.gate.set()
        old_tokens, _, _ = await _drain(first)
        result = await loading
        new_tokens, _, _ = await _drain(await second)
        await loop_engine.shutdown()
        return seen, result, old_tokens, new_tokens

    seen, result, old_tokens, new_tokens = asyncio.run(main())
    assert result == "loaded" and seen == {"running": set(), "steps": 5}  # "old" ran all 5 steps first
    assert old_tokens[("old", 0)] == [0, 1, 2, 3, 4] and new_tokens[("new", 0)] == [0, 1]
