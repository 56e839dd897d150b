"""The async engine loop: one background thread drives the (not thread-safe) `LLMEngine`.

HTTP handlers run on the asyncio event loop; the engine runs on a single thread of its own.
Handlers never touch the engine: they put "add" and "abort" commands into a thread-safe inbox
and await an `OutputStream`. The engine thread drains the inbox, calls `engine.step()`, turns
each changed `RequestOutput` into an immutable `RequestUpdate` (new tokens since the last
update, the cumulative text, the finish reason) and hands all updates of a step to the loop
with one `loop.call_soon_threadsafe`, which puts them on the per-request asyncio queues.
Copying the deltas on the engine thread means the loop never reads lists that the engine is
still appending to. `Engine` (a Protocol) is what the loop calls on the engine: `LLMEngine`'s
add_request / step / abort. Data flow: app -> inbox -> engine thread -> step -> updates -> queues -> SSE.

A weight load (`run_between_steps`, the admin route `/v1/load_weights`) goes through the same
inbox: from then on new requests are held, the requests in flight finish on the weights they
started with (and report that policy version), then the load runs on the engine thread and the
held requests are admitted under the new weights. No request is dropped or sees two versions.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from astrai.infer.outputs import EngineStats, RequestOutput
from astrai.infer.sampling import SamplingParams
from astrai.serve.metrics import ServerMetrics

logger = logging.getLogger("astrai.serve")

STATS_INTERVAL_S = 0.05  # how often the engine thread snapshots engine.stats() while busy


class Engine(Protocol):
    """What the server drives: `LLMEngine`'s stepping API, called from one thread only.

    `LLMEngine` satisfies it; tests pass fakes with the same methods. The engine's `config`
    (max_num_seqs, for the admission bound) and `describe()` (the startup line) are read when
    present."""

    max_model_len: int

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    with_logprobs: bool = True) -> None:
        """Queue a request; ValueError when it can never run (the 400 the client gets)."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one schedule -> forward -> sample step; the outputs of the requests it advanced."""
        ...

    def abort(self, request_id: str) -> None:
        ...

    def has_unfinished_requests(self) -> bool:
        ...

    def stats(self) -> EngineStats:
        ...


class EngineDeadError(RuntimeError):
    """The engine raised inside step(); the requests it was running cannot continue."""


class QueueFullError(RuntimeError):
    """Admitting this request would hold more sequences than the engine runs plus `max_waiting`."""


@dataclass(slots=True)
class SeqUpdate:
    index: int
    text: str                      # cumulative text of this sequence so far
    new_token_ids: list[int]       # tokens generated since the previous update
    new_logprobs: list[Any] | None  # one entry per new token (float or {id: Logprob}); None if off
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    outputs: list[SeqUpdate]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None  # only on the first update, when requested
    policy_version: int = 0  # the weights that produced this update


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one in-flight request."""

    stream: OutputStream
    arrival: float
    want_logprobs: bool
    n: int
    processed_logprobs: bool = False  # the sampler's behaviour log-probs rather than the raw model's
    num_sent: dict[int, int] = field(default_factory=dict)  # sequence index -> tokens sent
    first_token_at: float | None = None
    sent_prompt_logprobs: bool = False


class OutputStream:
    """What a handler awaits: updates for a group of engine requests (one per prompt)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_ids: Sequence[str]):
        self.request_ids = list(request_ids)
        self.queue: asyncio.Queue[RequestUpdate | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def batches(self) -> AsyncIterator[list[RequestUpdate]]:
        """Yield every update that is ready at once (a slow client gets them coalesced)."""
        while self.unfinished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for item in batch:
                if isinstance(item, BaseException):
                    self.unfinished.clear()
                    raise item
                if item.finished:
                    self.unfinished.discard(item.request_id)
            yield batch  # type: ignore[misc]


class AsyncEngine:
    """Runs `engine.step()` on a background thread and serves `OutputStream`s to the loop."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, max_waiting: int | None = None):
        self.engine = engine
        self.metrics = metrics
        # Admission bound: sequences admitted and not yet finished may be at most what the engine
        # runs at once plus `max_waiting`; beyond it submit() refuses at once (the app's 429)
        # instead of queueing without limit. Raised on the loop, lowered on the engine thread.
        max_num_seqs = int(getattr(getattr(engine, "config", None), "max_num_seqs", 256))
        self.max_waiting = 4 * max_num_seqs if max_waiting is None else int(max_waiting)
        self.capacity = max_num_seqs + self.max_waiting
        self.num_admitted = 0
        self._admit_lock = threading.Lock()
        self._inbox: collections.deque[tuple] = collections.deque()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._loads: list[tuple[Callable[[], Any], asyncio.Future]] = []  # engine thread: waiting for idle
        self._held: list[tuple] = []  # engine thread: "add" commands that came while a load waited
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = False  # engine thread: leave the loop
        self._closed = False  # event loop: accept no more requests
        self._last_stats = 0.0

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="astrai-engine", daemon=True)
        self._thread.start()

    async def submit(self, requests: Sequence[tuple[str, list[int]]], params: SamplingParams | list[SamplingParams],
                     want_logprobs: bool = False, processed_logprobs: bool = False) -> OutputStream:
        """Add one engine request per (request_id, prompt_ids), with `params` or each with its own
        (the same n); raise ValueError if the engine rejects any of them (then none of them runs).
        `processed_logprobs`: report the sampler's behaviour log-probs instead of the raw model's."""
        assert self._loop is not None, "AsyncEngine.start() was not called"
        if self._closed:
            raise EngineDeadError("the server is shutting down; retry on another replica")
        per_request = list(params) if isinstance(params, list) else [params] * len(requests)
        need = sum(int(getattr(p, "n", 1) or 1) for p in per_request)
        with self._admit_lock:
            if self.num_admitted + need > self.capacity:
                raise QueueFullError(
                    f"the server is at capacity ({self.num_admitted} sequences admitted, at most "
                    f"{self.capacity}: max_num_seqs plus max_waiting {self.max_waiting}); retry later")
            self.num_admitted += need
        stream = OutputStream(self._loop, [rid for rid, _ in requests])
        self._send(("add", list(requests), per_request, want_logprobs, stream, time.perf_counter(),
                    processed_logprobs))
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the client left while the engine thread was adding it
            self.abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (e.g. the client went away); their KV blocks are freed at once."""
        self._send(("abort", list(request_ids)))

    async def run_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread once no request is in flight (the requests running now
        finish first; new ones wait until it is done); its result, or its exception."""
        assert self._loop is not None, "AsyncEngine.start() was not called"
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        done: asyncio.Future = self._loop.create_future()
        self._send(("load", fn, done))
        return await done

    def abort_all(self) -> None:
        """Finish every in-flight request with finish_reason "abort" (graceful-shutdown deadline)."""
        self._send(("abort_all",))

    async def shutdown(self) -> None:
        """Abort whatever is still running, then stop and join the engine thread."""
        self._closed = True
        if self._thread is None:
            return
        self._send(("stop",))
        await asyncio.to_thread(self._thread.join, 30.0)
        self._thread = None

    def _release(self, num_seqs: int) -> None:
        with self._admit_lock:
            self.num_admitted -= num_seqs

    def _untrack(self, rid: str) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is not None:
            self._release(tracked.n)

    def _send(self, command: tuple) -> None:
        self._inbox.append(command)  # deque.append is atomic; no lock needed
        self._wakeup.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while True:
            self._drain_inbox()
            if self._stop:
                self._fail_waiting()
                return
            if self._loads and not self.engine.has_unfinished_requests():
                self._apply_loads()
                continue
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                self._publish_stats(force=True)
                self._wakeup.wait()
                self._wakeup.clear()

    def _drain_inbox(self) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "add" and self._loads:
                self._held.append(command)  # admitted once the waiting loads ran
            elif command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "load":
                self._loads.append(command[1:])
            elif command[0] == "abort":
                gone = set(command[1])
                for held in [h for h in self._held if gone & {rid for rid, _ in h[1]}]:
                    self._held.remove(held)
                    self._release(sum(int(getattr(p, "n", 1) or 1) for p in held[2]))
                for rid in command[1]:
                    if rid in self._tracked:
                        self.engine.abort(rid)
                        self._finish_metrics(rid, "abort")
                        self._untrack(rid)
            else:  # abort_all or stop: end every request the clients are still waiting on
                self._abort_all(reason="abort")
                self._stop = command[0] == "stop"

    def _apply_loads(self) -> None:
        """The engine is idle: run every waiting load, then admit the requests held meanwhile."""
        loads, self._loads = self._loads, []
        for fn, done in loads:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - the load's caller gets it; serving goes on
                self._call_loop(_set_exception, done, exc)
            else:
                self._call_loop(_set_value, done, result)
        held, self._held = self._held, []
        for command in held:
            self._add(*command[1:])

    def _fail_waiting(self) -> None:
        """Stopping: the loads and the held requests that never ran get an error, not silence."""
        error = EngineDeadError("the server is shutting down")
        for _, done in self._loads:
            self._call_loop(_set_exception, done, error)
        for command in self._held:
            self._call_loop(_set_exception, command[4].accepted, error)
        self._loads, self._held = [], []

    def _add(self, requests: list[tuple[str, list[int]]], params: list[SamplingParams], want_logprobs: bool,
             stream: OutputStream, arrival: float, processed_logprobs: bool = False) -> None:
        num_seqs = sum(int(getattr(p, "n", 1) or 1) for p in params)
        if self._stop:
            self._release(num_seqs)
            self._call_loop(_set_exception, stream.accepted, EngineDeadError("the server is shutting down"))
            return
        added: list[str] = []
        try:
            for (rid, prompt_ids), p in zip(requests, params):
                # without logprobs the engine skips copying per-token logprob lists every step
                self.engine.add_request(rid, prompt_ids, p, with_logprobs=want_logprobs)
                added.append(rid)
        except Exception as exc:  # noqa: BLE001 - any rejection goes back to the handler
            for rid in added:
                self.engine.abort(rid)
            self._release(num_seqs)
            self._call_loop(_set_exception, stream.accepted, exc)
            return
        for (rid, prompt_ids), p in zip(requests, params):
            self._tracked[rid] = _Tracked(stream, arrival, want_logprobs, int(getattr(p, "n", 1) or 1),
                                          processed_logprobs)
            if self.metrics is not None:
                self.metrics.count_prompt(len(prompt_ids))
        self._call_loop(_set_result, stream.accepted)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
            logger.exception("engine.step() failed; aborting %d requests", len(self._tracked))
            error = EngineDeadError(f"the engine failed while running this request: {exc!r}")
            deliveries = [(t.stream.queue, error) for t in self._tracked.values()]
            for rid in list(self._tracked):
                self._safe_abort(rid)
                self._untrack(rid)
            self._call_loop(_deliver, deliveries)
            return
        now = time.perf_counter()
        deliveries = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted while the step ran
            update = self._to_update(out, tracked, now)
            if update is not None:
                deliveries.append((tracked.stream.queue, update))
        if deliveries:
            self._call_loop(_deliver, deliveries)
        self._publish_stats()

    def _to_update(self, out: RequestOutput, tracked: _Tracked, now: float) -> RequestUpdate | None:
        seqs, num_new = [], 0
        for c in out.outputs:
            sent = tracked.num_sent.get(c.index, 0)
            new_ids = list(c.token_ids[sent:])
            if not new_ids and c.finish_reason is None:
                continue
            tracked.num_sent[c.index] = sent + len(new_ids)
            num_new += len(new_ids)
            lps = None
            if tracked.want_logprobs:
                raw = getattr(c, "raw_logprobs", None)
                source = raw if raw and not tracked.processed_logprobs else c.logprobs
                lps = list(source[sent:sent + len(new_ids)]) if source else []
            seqs.append(SeqUpdate(c.index, c.text, new_ids, lps, c.finish_reason,
                                  getattr(c, "stop_reason", None)))
        if num_new and tracked.first_token_at is None:
            tracked.first_token_at = now
        if self.metrics is not None and num_new:
            self.metrics.count_generated(num_new)
        prompt_lps = None
        if not tracked.sent_prompt_logprobs:
            prompt_lps = getattr(out, "prompt_logprobs", None)
            tracked.sent_prompt_logprobs = True
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            self._finish_metrics(out.request_id, reason)
            self._untrack(out.request_id)
        if not seqs and not out.finished:
            return None
        return RequestUpdate(out.request_id, seqs, bool(out.finished),
                             int(getattr(out, "num_cached_tokens", 0) or 0), prompt_lps,
                             int(getattr(out, "policy_version", 0) or 0))

    def _finish_metrics(self, rid: str, reason: str) -> None:
        tracked = self._tracked.get(rid)
        if self.metrics is None or tracked is None:
            return
        now = time.perf_counter()
        ttft = tpot = None
        num_tokens = max(tracked.num_sent.values(), default=0)
        if tracked.first_token_at is not None:
            ttft = tracked.first_token_at - tracked.arrival
            if num_tokens > 1:
                tpot = (now - tracked.first_token_at) / (num_tokens - 1)
        self.metrics.observe_finished(reason, ttft, tpot, now - tracked.arrival)

    def _abort_all(self, reason: str) -> None:
        deliveries = []
        for rid, tracked in list(self._tracked.items()):
            self._safe_abort(rid)
            self._finish_metrics(rid, reason)
            seqs = [SeqUpdate(i, "", [], [] if tracked.want_logprobs else None, reason)
                    for i in range(tracked.n)]
            deliveries.append((tracked.stream.queue, RequestUpdate(rid, seqs, True, 0, None,
                                                                   int(getattr(self.engine, "policy_version", 0)))))
            self._untrack(rid)
        if deliveries:
            self._call_loop(_deliver, deliveries)

    def _safe_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - abort is best effort after a failure
            logger.exception("engine.abort(%s) failed", rid)

    def _publish_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.metrics is None or (not force and now - self._last_stats < STATS_INTERVAL_S):
            return
        self._last_stats = now
        try:
            self.metrics.set_engine_stats(self.engine.stats())
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            logger.exception("engine.stats() failed")

    def _call_loop(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_value(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
