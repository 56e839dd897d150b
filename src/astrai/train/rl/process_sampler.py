"""The rollout process: the in-process engine moved into a child process of its own, behind the
sampler interface (``rl/sampler.py``), for ``async_steps`` (``async_rollout_source: process``).

The asynchronous pipeline (``rl/pipeline.py``) draws rollouts on a thread beside training; on a CPU
with a small model both threads are mostly Python and contend for Python's lock. This sampler keeps
the pipeline's thread (prompt draws, rewards, tools, packing: unchanged) but runs the engine in a
child process (``torch.multiprocessing``, started from a fork server) over the pipeline's copy of
the weights, whose tensors live in shared memory: the pipeline writes each policy version into them at a version
boundary, before it asks for that version's turns, and the child reads them only inside those
requests, so the weights never travel and no request sees a half-written version. Each call is one
message on a pipe (the turn requests out, the sampled turns back), answered before the next, so
which weights draw which rollout stays fixed by the schedule and a run stays reproducible; the
child holds no state a checkpoint needs (its prefix cache is keyed by policy version). The child
ignores SIGINT and SIGTERM (the trainer decides when the run ends), leaves when its pipe closes (the
trainer ended or was killed), and the trainer's ``close`` joins it; a child that dies is one error
naming its exit code.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from astrai.config import RLConfig
from astrai.model.matmul import current_cpu_matmul, set_cpu_matmul
from astrai.train.rl.engine_sampler import EngineSampler, engine_limits
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import EpisodeRunner
from astrai.train.rl.sampler import TurnRequest, TurnResult

POLL_S = 1.0  # how often a waiting trainer checks that the child is still alive
JOIN_TIMEOUT_S = 30.0  # close: how long the child gets to leave before it is terminated
SHM_DIR = "/dev/shm"  # where torch's shared tensors live on Linux (its file_descriptor strategy)


def shared_memory_room(num_bytes: int) -> str | None:
    """None when `SHM_DIR` can hold `num_bytes` more (or does not exist: another OS), else why not."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    free = stat.f_bavail * stat.f_frsize
    if free >= num_bytes:
        return None
    return (f"the rollout process shares the copy of the weights ({num_bytes / 2**20:.0f} MiB) through {SHM_DIR}, "
            f"which has {free / 2**20:.0f} MiB free (a container's default is 64 MB)")


class ProcessSampler:
    """Draws turns on an engine in a child process over `model`, whose weights are shared with it
    (the caller writes each version into `model` before asking for that version's turns);
    `threads`: the child's torch intra-op threads."""

    def __init__(self, model: nn.Module, tokenizer: Any, num_seqs: int, max_len: int, threads: int,
                 bf16: bool = False, keep_kv_pool: bool = False, record_routing: bool = False):
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("async_rollout_source=process runs the rollout engine in a CPU process, but the policy is "
                             f"on {next(model.parameters()).device}; use --async_rollout_source thread")
        num_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        if (short := shared_memory_room(num_bytes)) is not None:
            raise ValueError(f"{short}; give it more (docker run --shm-size, compose shm_size) or use "
                             "--async_rollout_source thread")
        flats = share_flat(model)  # the child maps these storages; later writes are seen there
        ctx = start_context()
        self.conn, child_conn = ctx.Pipe()
        engine = {"num_seqs": num_seqs, "max_len": max_len, "bf16": bf16, "keep_kv_pool": keep_kv_pool,
                  "record_routing": record_routing, "threads": threads, "cpu_matmul": current_cpu_matmul()}
        self.process = ctx.Process(target=serve_turns, args=(child_conn, meta_skeleton(model), flats, tokenizer, engine),
                                   name="astrai-rollout-engine", daemon=True)  # daemon: gone with the trainer
        self.process.start()
        child_conn.close()  # the child's end lives in the child only: its exit shows here as EOF
        # a run that fails before its loop closes the pipeline still ends the child once this goes
        self._finalizer = weakref.finalize(self, stop_child, self.process, self.conn)
        self._max_model_len = self._call("starting the engine", "ready")

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def set_policy_version(self, version: int) -> None:
        self._call("publishing a policy version", "version", version)

    def sync_weights(self, version: int) -> None:
        """A no-op: the child reads the shared weights the pipeline wrote for `version`."""

    @contextlib.contextmanager
    def batch(self, num_seqs: int, longest: int) -> Iterator[None]:
        self._call("reserving the KV pool", "begin", num_seqs, longest)
        try:
            yield
        finally:
            if self.process.is_alive():
                self._call("releasing the KV pool", "end")

    def sample(self, requests: list[TurnRequest], return_logprobs: bool = True) -> list[TurnResult]:
        return self._call("generating", "sample", requests, return_logprobs)

    def close(self) -> None:
        """Ask the child to leave and wait for it (terminated past JOIN_TIMEOUT_S); idempotent."""
        self._finalizer()

    def _call(self, what: str, op: str, *args: Any) -> Any:
        """Send one request and wait for its answer, checking that the child lives meanwhile."""
        try:
            self.conn.send((op, *args))
            while not self.conn.poll(POLL_S):
                if not self.process.is_alive():
                    raise EOFError
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            self.process.join(JOIN_TIMEOUT_S)
            raise RuntimeError(f"the rollout process (pid {self.process.pid}) exited with code {self.process.exitcode} "
                               f"while {what}; its own error, if any, is above on stderr (a negative code is the "
                               "signal that ended it, -9 often the out-of-memory killer); lower --batch_per_device "
                               "or use --async_rollout_source thread") from e
        if status == "error":
            raise RuntimeError(f"the rollout process failed while {what}:\n{value}")
        return value


def model_tensors(model: nn.Module) -> list[Tensor]:
    """`model`'s parameters and buffers, each once (tied weights are one tensor), in a fixed order."""
    seen: dict[int, Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    return list(seen.values())


def share_flat(model: nn.Module) -> dict[torch.dtype, Tensor]:
    """Move `model`'s tensors into one shared-memory buffer per dtype, each tensor becoming a view of
    its buffer (in place: writes into the tensors land in the buffers). A child is handed the few
    buffers, not one file descriptor per tensor: a fork server passes at most 256 (SmolLM2 has 272)."""
    tensors = model_tensors(model)
    flats = {}
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        flats[dtype] = torch.empty(sum(t.numel() for t in tensors if t.dtype == dtype), dtype=dtype).share_memory_()
    offsets = dict.fromkeys(flats, 0)
    with torch.no_grad():
        for t in tensors:
            view = flats[t.dtype][offsets[t.dtype]:offsets[t.dtype] + t.numel()].view_as(t)
            view.copy_(t)
            t.data = view
            offsets[t.dtype] += t.numel()
    return flats


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose tensors are on the meta device (no storage to send); ties are kept."""
    memo: dict[int, Any] = {}
    for t in model_tensors(model):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def fill_from_flat(skeleton: nn.Module, flats: dict[torch.dtype, Tensor]) -> nn.Module:
    """`meta_skeleton`'s copy given `share_flat`'s buffers: each tensor the same view of them."""
    offsets = dict.fromkeys(flats, 0)
    new: dict[int, Tensor] = {}
    for t in model_tensors(skeleton):
        view = flats[t.dtype][offsets[t.dtype]:offsets[t.dtype] + t.numel()].view(t.shape)
        new[id(t)] = nn.Parameter(view, requires_grad=False) if isinstance(t, nn.Parameter) else view
        offsets[t.dtype] += t.numel()
    for module in skeleton.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = new[id(t)]
    return skeleton


def start_context() -> Any:
    """How children start: from a fork server that has imported this module once (a run's first child
    pays the imports, about 2 s; each later one, another run in the same process, about 0.2 s), or
    by spawn where there is no fork server (Windows). Never a plain fork of the trainer, whose
    threads and locks a forked child would inherit."""
    if "forkserver" not in torch.multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def stop_child(process: Any, conn: Any) -> None:
    """`ProcessSampler.close`: ask the child to leave and wait for it (terminated past JOIN_TIMEOUT_S)."""
    if process.is_alive():
        with contextlib.suppress(OSError):
            conn.send(("close",))
        process.join(JOIN_TIMEOUT_S)
    if process.is_alive():
        process.terminate()
        process.join(JOIN_TIMEOUT_S)
    conn.close()


def serve_turns(conn: Any, skeleton: nn.Module, flats: dict[torch.dtype, Tensor], tokenizer: Any,
                engine: dict[str, Any]) -> None:
    """The child: an engine over the shared weights (`skeleton` filled from `flats`), answering the
    trainer's requests one by one."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the trainer stops the run and then this process
        signal.signal(sig, signal.SIG_IGN)
    model = fill_from_flat(skeleton, flats)
    torch.set_num_threads(engine["threads"])
    set_cpu_matmul(engine["cpu_matmul"])  # the trainer's choice of CPU product kernels, so samples match
    sampler = EngineSampler(model, tokenizer, engine["num_seqs"], engine["max_len"], bf16=engine["bf16"],
                            keep_kv_pool=engine["keep_kv_pool"], record_routing=engine["record_routing"])
    batch: contextlib.AbstractContextManager[None] | None = None
    ops = {"ready": lambda: sampler.max_model_len, "version": sampler.set_policy_version, "sample": sampler.sample}
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if op == "close":
            return
        try:
            if op == "begin":
                batch = sampler.batch(*args)
                batch.__enter__()
                value = None
            elif op == "end":
                if batch is not None:
                    batch.__exit__(None, None, None)
                batch, value = None, None
            else:
                with torch.no_grad():
                    value = ops[op](*args)
            reply = ("ok", value)
        except Exception:  # the trainer raises it, with this traceback
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


def process_runner(model: nn.Module, tokenizer: Any, rl: RLConfig, num_seqs: int, rewards: RewardSet, threads: int,
                   random_seed: int = 0, bf16: bool = False) -> EpisodeRunner:
    """An episode runner drawing from an engine in a child process over `model` (shared), sized as
    ``engine_runner`` sizes the in-process one."""
    max_prompt_len, max_len = engine_limits(model, rl)
    sampler = ProcessSampler(model, tokenizer, num_seqs, max_len, threads, bf16=bf16, keep_kv_pool=rl.keep_kv_pool,
                             record_routing=rl.routing_replay)
    return EpisodeRunner(sampler, tokenizer, rl, rewards, max_prompt_len, random_seed)
