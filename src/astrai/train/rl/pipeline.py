"""The asynchronous rollout pipeline (``rl.async_steps`` k >= 1): rollouts drawn k ahead of training
on a thread of their own, over their own copy of the weights, on a fixed schedule.

The online loop (``rl/loop.py``) numbers its rollouts i = 0, 1, ... (rollout i serves the optimizer
steps from i * steps_per_rollout on). At the boundary before rollout i the loop hands the pipeline
the weights it has then (policy version i * steps_per_rollout) as the policy of rollout i + k, and
takes rollout i, drawn earlier with the weights of the boundary before rollout i - k (the first
k + 1 rollouts all with the starting weights). Which weights draw which rollout is fixed by i and
k, never by timing, so a run is reproducible; the thread only decides when the work happens. The
rollout thread draws prompts and generates exactly as the synchronous loop does (``rl/draws.py``:
the same sampler order, seeds and dynamic sampling), through an engine over its copy of the
weights (``rl/engine_sampler.py``), with its own torch intra-op thread count (torch keeps it per
thread, so the trainer's and the rollout's threads each run on their own cores) and, across
ranks, its own gloo group for the draws' agreements, so none of its collectives meets the
trainer's. ``async_rollout_source`` (``rollout_source``) moves that engine into a spawned process
over the copy's weights in shared memory (``rl/process_sampler.py``; auto: on a CPU), so the
engine's Python never waits for the trainer's lock; the thread then only draws prompts, scores and
packs. A checkpoint waits for the rollouts in flight and saves them (``state_dict``): they
are far smaller than the k policy snapshots that would regenerate them (docs/training.md,
"Asynchronous rollouts").
"""

from __future__ import annotations

import copy
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from astrai.data.sampler import ResumableSampler
from astrai.train import dist
from astrai.train.rl.data import Rollout
from astrai.train.rl.draws import RolloutDraws
from astrai.train.rl.engine_sampler import unsharded_replica
from astrai.train.rl.process_sampler import shared_memory_room
from astrai.train.rl.runner import EpisodeRunner

CLOSE_TIMEOUT_S = 120.0  # how long the run's end waits for the rollout thread's current draw


@dataclass
class Position:
    """Where the rollout thread's prompt order stands (the loop's sampler position, ahead by k)."""

    epoch: int = 0
    consumed_samples: int = 0


@dataclass
class Job:
    """Rollout `index`, drawn for optimizer step `step` at `policy_version`; `weights` are that
    version's full weights, or None: the previous job's (the first k + 1 rollouts share them)."""

    index: int
    step: int
    policy_version: int
    weights: dict[str, Tensor] | None


@dataclass
class Drawn:
    """A finished job: its rollout and the prompt position after its draws."""

    rollout: Rollout
    epoch: int
    consumed_samples: int


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """A copy of `model`'s full parameters and buffers (plain, DDP or FSDP2: a sharded tensor is
    all-gathered, a collective every rank makes at the same point)."""
    from torch.distributed.tensor import DTensor

    source = dist.unwrap_model(model)
    return {name: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for name, v in [*source.named_parameters(), *source.named_buffers()]}


def rollout_source(rl: Any, model: nn.Module, device: torch.device) -> str:
    """Where ``async_steps``' engine runs: ``async_rollout_source``, auto resolved to a process of its
    own on a CPU (the trainer's and the engine's Python then never wait for each other's lock:
    docs/training.md, "Asynchronous rollouts") when shared memory can hold a copy of `model`'s
    weights (a note says why not), and to the rollout thread on an accelerator."""
    if rl.async_rollout_source != "auto":
        return rl.async_rollout_source
    if torch.device(device).type != "cpu":
        return "thread"
    source = dist.unwrap_model(model)
    num_bytes = sum(t.numel() * t.element_size() for t in [*source.parameters(), *source.buffers()])
    if (short := shared_memory_room(num_bytes)) is not None:
        print(f"note: async_rollout_source auto: {short}, so the engine runs on the rollout thread", file=sys.stderr)
        return "thread"
    return "process"


def weights_copy(model: nn.Module) -> nn.Module:
    """A plain module for the rollout engine, of `model`'s architecture, without gradients; its
    weights come from each job (``full_weights``)."""
    from astrai.model.transformer import CausalLM

    raw = dist.unwrap_model(model)
    if isinstance(raw, CausalLM):
        return unsharded_replica(raw)
    return copy.deepcopy(raw).eval().requires_grad_(False)


class RolloutPipeline:
    """Rollouts k ahead on a thread (module docstring); `make_runner` builds its runner over the copy. `total` is the run's number of rollouts
    (none is drawn past it); `threads` the rollout thread's torch intra-op threads."""

    def __init__(self, model: nn.Module, cfg: Any, prompts: Any, num_prompts: int,
                 make_runner: Callable[[nn.Module], EpisodeRunner], steps_per_rollout: int, total: int, threads: int):
        self.k, self.steps_per_rollout, self.total, self.threads = cfg.rl.async_steps, steps_per_rollout, total, threads
        self.copy = weights_copy(model)
        self.runner = make_runner(self.copy)  # the in-process engine over the copy, or rollout servers fed from it
        rank, world = dist.get_rank() if dist.is_distributed() else 0, dist.get_world_size() if dist.is_distributed() else 1
        # the draws' agreements run on the rollout thread, beside the trainer's collectives: a group of their own
        self.group = torch.distributed.new_group(backend="gloo") if world > 1 else None
        if hasattr(self.runner.sampler, "ranks_group"):  # rollout servers: their weight syncs agree there too
            self.runner.sampler.ranks_group = self.group
        sampler = ResumableSampler(len(prompts), seed=cfg.train.random_seed, rank=rank, world_size=world, shuffle=True)
        self.draws = RolloutDraws(self.runner, prompts, sampler, num_prompts, cfg.rl, rank, world,
                                  lambda: self.cancelled, self._any_rank)
        self.position = Position()
        self.restored = False  # the rollouts drawn ahead and the position after them came from a checkpoint
        self.cancelled = False
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.done: dict[int, Drawn] = {}
        self.pending: set[int] = set()  # handed to the thread, not drawn yet
        self.cond = threading.Condition()
        self.next_index = 0  # the first rollout not handed to the thread (or restored)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _any_rank(self, flag: bool) -> bool:
        return dist.any_rank(flag, self.group) if self.group is not None else flag

    # ---------------------------------------------------------------------------- the trainer's side

    def start(self, epoch: int, consumed_samples: int) -> None:
        """Start the thread; the prompt order continues from the loop's position (after the
        rollouts restored from a checkpoint, when there are any)."""
        if not self.restored:
            self.position = Position(epoch, consumed_samples)
        self.thread = threading.Thread(target=self._work, name="astrai-rollouts", daemon=True)
        self.thread.start()

    def take(self, index: int, model: nn.Module, policy_version: int) -> tuple[Drawn, float]:
        """Rollout `index`, after handing the thread the current weights (`model` at
        `policy_version`) as the policy of every rollout up to index + k not yet handed out; and
        the seconds the trainer waited for it."""
        last = min(index + self.k, self.total - 1)
        # a resume that restored none (another number of ranks) starts the schedule again at `index`
        self.next_index = max(self.next_index, index)
        if self.next_index <= last:
            weights = full_weights(model)  # every rank at the same point (FSDP gathers)
            for j in range(self.next_index, last + 1):
                with self.cond:
                    self.pending.add(j)
                self.jobs.put(Job(j, j * self.steps_per_rollout, policy_version, weights))
                weights = None  # the later ones draw with the same weights, already loaded
            self.next_index = last + 1
        start = time.perf_counter()
        with self.cond:
            while index not in self.done and self.error is None:
                self.cond.wait()
            self._raise()
            drawn = self.done.pop(index)
        return drawn, time.perf_counter() - start

    def settle(self) -> None:
        """Wait until every rollout handed out is drawn (a checkpoint saves them)."""
        with self.cond:
            while self.error is None and self.pending:
                self.cond.wait()
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the rollout thread failed: {self.error}") from self.error

    def _load(self, weights: dict[str, Tensor]) -> None:
        into = {**dict(self.copy.named_parameters()), **dict(self.copy.named_buffers())}
        for name, value in weights.items():
            into[name].copy_(value)

    def end_on(self, model: nn.Module, policy_version: int) -> None:
        """After `close`: the sampler takes the final weights (rollout servers serve them next)."""
        self._load(full_weights(model))
        self.runner.sampler.sync_weights(policy_version)

    def close(self) -> None:
        """Stop the thread: the draw in progress ends at its next check, nothing more starts."""
        self.cancelled = True
        if self.thread is not None:
            self.jobs.put(None)
            # bounded: a thread left in a draw's agreement with a rank that died never returns (a daemon)
            self.thread.join(timeout=CLOSE_TIMEOUT_S)
            self.thread = None
        if hasattr(self.runner.sampler, "process"):  # the rollout process (rl/process_sampler.py) leaves too
            self.runner.sampler.close()

    # ---------------------------------------------------------------------------- the rollout thread

    def _work(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's own intra-op threads (torch keeps them per thread)
        while (job := self.jobs.get()) is not None:
            try:
                with torch.no_grad():
                    drawn = self._draw(job)
            except BaseException as e:  # the trainer re-raises it at its next take
                with self.cond:
                    self.error = e
                    self.cond.notify_all()
                return
            if drawn is None:  # cancelled
                return
            with self.cond:
                self.done[job.index] = drawn
                self.pending.discard(job.index)
                self.cond.notify_all()

    def _draw(self, job: Job) -> Drawn | None:
        if job.weights is not None:
            self._load(job.weights)
        # rollout servers: the copy's weights go out now, while the trainer computes later steps
        self.runner.sampler.sync_weights(job.policy_version)
        self.runner.sampler.set_policy_version(job.policy_version)
        rollout = self.draws.rollout(self.position, job.step, job.policy_version)
        if rollout is None:
            return None
        return Drawn(rollout, self.position.epoch, self.position.consumed_samples)

    # ---------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The rollouts drawn ahead (waited for) by index, and the prompt position after them."""
        self.settle()
        with self.cond:
            done = {j: d for j, d in self.done.items()}
        return {"next_index": self.next_index, "epoch": self.position.epoch,
                "consumed_samples": self.position.consumed_samples,
                "rollouts": {j: {**d.rollout.state_dict(), "after": [d.epoch, d.consumed_samples]}
                             for j, d in sorted(done.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state["next_index"])
        self.position = Position(int(state["epoch"]), int(state["consumed_samples"]))
        self.restored = True
        for j, saved in state["rollouts"].items():
            saved = dict(saved)
            epoch, consumed = saved.pop("after")
            self.done[int(j)] = Drawn(Rollout.from_state_dict(saved), int(epoch), int(consumed))
