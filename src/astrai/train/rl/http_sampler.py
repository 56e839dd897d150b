"""The HTTP sampler: rollout turns drawn by `astrai serve` replicas (``rl.rollout_servers``).

The second implementation of the sampler interface (``rl/sampler.py``; the first is the in-process
engine of ``rl/engine_sampler.py``), so the episode runner, every objective, multi-turn episodes
and evaluation during training run unchanged. It talks to the servers only over HTTP (never by
importing ``astrai.serve``), in token ids: each turn's requests go to `/v1/completions` as prompt
token ids with the per-request seeds the in-process engine would use (`seeds`, one per prompt), and
come back as `token_ids` (`return_token_ids`), the sampler's behaviour log-probs
(`logprobs_mode: processed_logprobs`, from the function the trainer uses) and the `policy_version`
that drew them, so nothing is decoded and re-encoded.

Reproducibility: a turn's requests are split over the servers in contiguous blocks (all samples
of a group in one request, on one server), and each server gets its share as one HTTP request per
sampling setting, sent one after another, so a server's batches never depend on timing. Every
fresh rollout is preceded by a weight load (which empties the server's prefix cache), so a run
against the same servers resumes bit for bit.

Weights go to the servers by one of two transports (``rollout_weight_transport``), from rank 0 while
the other ranks wait at a collective. filesystem: rank 0 publishes the policy as a model directory
(the atomic publish with its manifest) under ``rollout_weights_dir`` and posts `/v1/load_weights`
with its path to every server; a LoRA run publishes only its adapter (PEFT's layout, naming the
base model, ``param_path``), which each server merges onto that base. broadcast: at the first sync rank 0
opens a group of its own with the servers (`/v1/weight_group`; the trainer's process group, if any, is
untouched) on the backend `model/weight_broadcast.py` chooses (NCCL when the policy and every server's
weights are on CUDA, the tensors sent from device memory; gloo otherwise, through host memory), and
each sync posts `/v1/load_weights` (transport broadcast) to every server and broadcasts the tensors one
by one, in name order, with no file written: a LoRA run's adapter alone when every server reads its
base (the server's own model or one under its --weights_dir, as `GET /v1/weight_group` says), its
merged weights otherwise. The collectives run on a thread of their own while this one waits, at most
``rollout_timeout``, for them and for every server's answer: a server that refuses or fails stops the
sync at once, and one that never answers is a timeout, never a hang. Every HTTP call has a
timeout (``rollout_timeout``) and bounded retries (``rollout_retries``, for connection errors and
5xx; none for a broadcast load, which the collective cannot repeat); a failure names the server, the
policy version and the transport, and stops the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
import torch
from torch import nn

from astrai.config import RLConfig
from astrai.model import weight_broadcast
from astrai.model.hf import save_model
from astrai.train import dist
from astrai.train.publish import publish_model_dir
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import EpisodeRunner, episode_max_len, resolve_max_prompt_len
from astrai.train.rl.sampler import SampledTurn, TurnRequest, TurnResult

RETRY_WAIT_S = 1.0  # before the first retry; doubled for each next one
WEIGHTS_PREFIX = "policy_"  # the published versions: <rollout_weights_dir>/policy_<version:08d>


class RolloutServerError(RuntimeError):
    """A rollout server failed or refused; the message names it, the policy version and the transport."""


class HttpSampler:
    """Draws turns from `astrai serve` replicas over HTTP (module docstring)."""

    def __init__(self, servers: list[str], model: nn.Module, tokenizer: Any, weights_dir: str | os.PathLike,
                 admin_key: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 2, needed_len: int = 0, transport: str = "filesystem", base_model: str | None = None):
        if dist.is_fsdp(model):
            raise ValueError("rollout_servers: the policy is sharded (parallel_mode fsdp) and the filesystem "
                             "transport publishes it from rank 0; use --parallel_mode ddp or none with rollout servers")
        self.servers = [s.rstrip("/") for s in servers]
        self.model, self.tokenizer = model, tokenizer
        self.weights_dir = Path(weights_dir)
        self.admin_key, self.api_key = admin_key, api_key
        self.timeout, self.retries = timeout, retries
        self.transport = transport
        self.base_model = base_model  # a LoRA run's base (param_path): the filesystem transport sends the adapter
        self.group: Any = None  # broadcast: the group with the servers, opened at the first sync
        self.backend = "gloo"  # broadcast: the group's backend (weight_broadcast.choose_backend)
        self.adapter: dict[str, Any] | None = None  # broadcast: the adapter spec when only a LoRA adapter travels
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="astrai-weight-send")  # the collectives' thread
        self.ranks_group: Any = None  # where the trainer's ranks agree on a sync (async_steps: the rollout thread's)
        self.policy_version = 0
        self.synced_version: int | None = None  # the version every server holds (None: not loaded yet)
        self.sync_seconds = 0.0  # time spent publishing and loading weights, whole run
        self.sync_bytes = 0  # weight bytes sent (broadcast) or published (filesystem), whole run
        self.client = httpx.Client(timeout=timeout)
        self.pool = ThreadPoolExecutor(len(self.servers), thread_name_prefix="astrai-rollout")
        cards = [self._call(url, "GET", "/v1/models", "connect")["data"][0] for url in self.servers]
        self.model_name = [c["id"] for c in cards]
        self._max_model_len = min(int(c.get("max_model_len") or 0) for c in cards)
        if needed_len and self._max_model_len < needed_len:
            short = next(url for url, c in zip(self.servers, cards) if int(c.get("max_model_len") or 0) < needed_len)
            raise ValueError(f"rollout server {short} serves max_model_len {self._max_model_len} but this run's "
                             f"episodes reach {needed_len} tokens (max_prompt_len + rollout_max_tokens); start it "
                             f"with --max_model_len {needed_len} or more, or lower --max_prompt_len")

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version

    def sync_weights(self, version: int) -> None:
        """Rank 0 publishes the policy as `version` and every server loads it; the other ranks wait
        (a collective: every rank calls it at the same point). Skipped when the servers hold it."""
        if self.synced_version == version:
            return
        start = time.perf_counter()
        error = None
        if dist.get_rank() == 0:
            try:
                if self.transport == "broadcast":
                    self._broadcast(version)
                else:
                    self._publish_and_load(version)
            except (RolloutServerError, OSError) as exc:
                error = exc
        if dist.any_rank(error is not None, self.ranks_group):  # every rank stops, none waits in a collective alone
            raise error or RolloutServerError(f"rank 0 failed to load policy version {version} into the rollout "
                                              f"servers ({self.transport} transport); see its error")
        self.synced_version = version
        self.sync_seconds += time.perf_counter() - start

    def _publish_and_load(self, version: int) -> None:
        from astrai.model.lora import has_lora, save_adapter

        path = self.weights_dir / f"{WEIGHTS_PREFIX}{version:08d}"
        if has_lora(self.model) and self.base_model:  # the adapter alone; the servers hold the base
            base = str(Path(self.base_model).resolve())
            write = lambda d: save_adapter(self.model, d, base_model_name_or_path=base)  # noqa: E731
        else:
            write = lambda d: save_model(self.model, d, tokenizer=self.tokenizer)  # noqa: E731
        try:
            publish_model_dir(path, version, write)
            self.sync_bytes += sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        except OSError as exc:
            raise RolloutServerError(f"publishing policy version {version} to {path} failed (filesystem "
                                     f"transport): {exc}") from None
        body = {"path": str(path.resolve()), "policy_version": version}
        list(self.pool.map(lambda url: self._call(url, "POST", "/v1/load_weights", f"load policy version {version} "
                                                  "(filesystem transport)", body, admin=True), self.servers))
        for old in self.weights_dir.glob(f"{WEIGHTS_PREFIX}*"):  # every server holds `version` now
            if old.name != path.name:
                shutil.rmtree(old, ignore_errors=True)

    def _payload(self) -> dict[str, torch.Tensor]:
        """What a broadcast sends: the adapter tensors when only the adapter travels, else what the
        servers' models hold (the policy's tensors; a LoRA run's adapters merged)."""
        from astrai.model.lora import has_lora, lora_state_dict, merged_state_dict

        if self.adapter is not None:
            return lora_state_dict(self.model)
        return merged_state_dict(self.model) if has_lora(self.model) else self.model.state_dict()

    def _adapter_spec(self, infos: list[dict[str, Any]]) -> dict[str, Any] | None:
        """A LoRA run sends only its adapter when every server reads its base (param_path): the
        server's own model directory, or one under its --weights_dir; otherwise the merged weights."""
        from astrai.model.lora import has_lora, peft_config

        if not (has_lora(self.model) and self.base_model):
            return None
        base = Path(self.base_model).resolve()
        for url, info in zip(self.servers, infos):
            root = info.get("weights_dir")
            if base != Path(info.get("model_dir", "")) and not (root and base.is_relative_to(root)):
                print(f"note: rollout server {url} serves {info.get('model_dir')}, not this run's base {base}: "
                      "the broadcast transport sends the merged weights, not only the adapter", file=sys.stderr)
                return None
        config = peft_config(self.model, None)
        return {"base_model": str(base), "scaling": config["lora_alpha"] / config["r"]}

    def _open_group(self) -> None:
        """Rank 0 of a group with the servers (ranks 1..N): the backend both ends can use, a store on a
        free port of the address the servers reach this machine at, each server asked to join over HTTP."""
        infos = [self._call(url, "GET", "/v1/weight_group", "describe its weights (broadcast transport)", admin=True)
                 for url in self.servers]
        device = next(self.model.parameters()).device
        self.backend = weight_broadcast.choose_backend(device, [info.get("backends", ["gloo"]) for info in infos],
                                                       gpus=[weight_broadcast.gpu_id(device), *(i.get("gpu") for i in infos)])
        self.adapter = self._adapter_spec(infos)
        weights = dict(sorted(self._payload().items()))  # name order: what `_send_all` sends
        host, port = self.servers[0].split("//", 1)[1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=self.timeout) as probe:
            addr = probe.getsockname()[0]  # this machine, as the servers' network sees it
        with socket.socket() as s:
            s.bind((addr, 0))
            group_port = s.getsockname()[1]
        size = len(self.servers) + 1
        made: list[Any] = []
        failed: list[BaseException] = []

        def make() -> None:  # blocks until every server joined; a daemon: a refused join leaves it waiting
            try:
                made.append(weight_broadcast.open_group(self.backend, addr, group_port, 0, size, self.timeout))
            except weight_broadcast.WeightBroadcastError as exc:
                failed.append(exc)

        maker = threading.Thread(target=make, daemon=True, name="astrai-weight-group")
        maker.start()
        body = {"master_addr": addr, "master_port": group_port, "world_size": size, "timeout_s": self.timeout,
                "backend": self.backend, "dtype": weight_broadcast.dtype_name(next(iter(weights.values())).dtype),
                "tensors": {n: list(t.shape) for n, t in weights.items()}, "adapter": self.adapter}
        list(self.pool.map(lambda i: self._call(
            self.servers[i], "POST", "/v1/weight_group", f"join the weight group (broadcast transport, {self.backend})",
            {**body, "rank": i + 1}, admin=True), range(len(self.servers))))
        maker.join(self.timeout)
        if not made:
            why = f": {failed[0]}" if failed else ""
            raise RolloutServerError(f"the {self.backend} weight group at {addr}:{group_port} did not form within "
                                     f"{self.timeout:g} s (broadcast transport){why}; check that the servers can "
                                     "reach this address")
        self.group = made[0]

    def _send_all(self, weights: dict[str, torch.Tensor]) -> int:
        """On the sender thread: every tensor of `weights` (in name order), in the first one's dtype
        (the wire dtype the servers were told at the group's opening); the bytes sent."""
        wire = next(iter(weights.values())).dtype
        num_bytes = 0
        for weight in weights.values():  # one tensor at a time: with gloo, at most one extra host copy
            tensor = weight_broadcast.send_view(weight.to(wire), self.backend)
            weight_broadcast.broadcast(self.group, tensor, self.timeout, self.backend)
            num_bytes += tensor.numel() * tensor.element_size()
        return num_bytes

    def _broadcast(self, version: int) -> None:
        if self.group is None:
            self._open_group()
        weights = dict(sorted(self._payload().items()))
        what = f"load policy version {version} (broadcast transport, {self.backend})"
        posts = [self.pool.submit(self._call, url, "POST", "/v1/load_weights", what,
                                  {"policy_version": version, "transport": "broadcast"}, admin=True, retries=0)
                 for url in self.servers]
        sending = self.sender.submit(self._send_all, weights)
        done, pending = wait([sending, *posts], timeout=self.timeout, return_when=FIRST_EXCEPTION)
        error = next((f.exception() for f in done if f.exception() is not None), None)
        if error is None and not pending:
            self.sync_bytes += sending.result()
            return
        weight_broadcast.abort(self.group)  # the other members' state is unknown: the next sync opens a new group
        self.group = None
        if isinstance(error, RolloutServerError):
            raise error  # a server refused or failed: it is named
        if error is not None:
            raise RolloutServerError(f"broadcasting policy version {version} to the rollout servers {self.servers} "
                                     f"failed (broadcast transport, {self.backend}): {error}") from None
        raise RolloutServerError(f"policy version {version} did not reach the rollout servers {self.servers} within "
                                 f"{self.timeout:g} s (broadcast transport, {self.backend}): a server stopped "
                                 "answering or the collective is stuck; see the servers' logs")

    def batch(self, num_seqs: int, longest: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the servers hold their own KV pools

    def sample(self, requests: list[TurnRequest], return_logprobs: bool = True) -> list[TurnResult]:
        """Contiguous blocks of the requests to the servers (in parallel); each server's block as one
        HTTP request per sampling setting, in order; the results in request order."""
        num = len(self.servers)
        blocks = [list(range(len(requests) * s // num, len(requests) * (s + 1) // num)) for s in range(num)]
        parts = self.pool.map(lambda s: self._sample_on(s, [requests[i] for i in blocks[s]], return_logprobs),
                              range(num))
        return [result for part in parts for result in part]

    def _sample_on(self, server: int, requests: list[TurnRequest], return_logprobs: bool) -> list[TurnResult]:
        results: list[TurnResult | None] = [None] * len(requests)
        for same in _by_setting(requests):
            out = self._completions(server, [requests[i] for i in same], return_logprobs)
            for i, result in zip(same, out):
                results[i] = result
        return results  # type: ignore[return-value]

    def _completions(self, server: int, requests: list[TurnRequest], return_logprobs: bool) -> list[TurnResult]:
        first = requests[0]
        s, n = first.sampling, first.n
        body: dict[str, Any] = {
            "model": self.model_name[server], "prompt": [list(r.prompt_ids) for r in requests], "n": n,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            # the in-process engine's defaults, sent so a server's generation_config cannot change them
            "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_tokens": 0, "ignore_eos": False, "return_token_ids": True, "logprobs_mode": "processed_logprobs"}
        if return_logprobs:
            body["logprobs"] = 0
        if first.seed is not None:
            body["seeds"] = [r.seed for r in requests]
        url = self.servers[server]
        out = self._call(url, "POST", "/v1/completions", f"sample at policy version {self.policy_version}", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        version = int(out.get("policy_version", -1))
        results = []
        for p, r in enumerate(requests):
            samples = [SampledTurn(list(c["token_ids"]), [float(v) for v in c["logprobs"]["token_logprobs"]]
                                   if return_logprobs else [], c["finish_reason"], c["text"])
                       for c in choices[p * n:(p + 1) * n]]
            results.append(TurnResult(samples, version, len(r.prompt_ids)))
        return results

    def _call(self, url: str, method: str, route: str, what: str, body: dict[str, Any] | None = None,
              admin: bool = False, retries: int | None = None) -> dict[str, Any]:
        """One HTTP call with `timeout` and up to `retries` retries (default: the run's; connection
        errors, 5xx, 429); a 4xx or the last failure is a RolloutServerError naming the server and `what`."""
        key = self.admin_key if admin else self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        pause, problem, attempts = RETRY_WAIT_S, "", 0
        for attempt in range((self.retries if retries is None else retries) + 1):
            attempts += 1
            if attempt:
                time.sleep(pause)
                pause *= 2
            try:
                r = self.client.request(method, url + route, json=body, headers=headers)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc or 'no answer'}"
                continue
            if r.status_code == 200:
                return r.json()
            problem = f"HTTP {r.status_code}: {_message(r)}"
            if r.status_code < 500 and r.status_code != 429:
                break
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        raise RolloutServerError(f"rollout server {url} failed to {what} ({method} {route}){tries}: {problem}; "
                                 "check that it is running (its log), reachable, and started with the flags this "
                                 "run needs (--admin_key, --weights_dir)")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.sender.shutdown(wait=False)
        self.client.close()


def _by_setting(requests: list[TurnRequest]) -> Iterator[list[int]]:
    """Indices of the requests that share one HTTP request: the same sampling, n and seededness, in
    order of first appearance (evaluation mixes greedy and sampled episodes in one turn)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault((r.sampling, r.n, r.seed is None), []).append(i)
    yield from groups.values()


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - not our error body: the start of whatever it is
        return r.text[:200]


def http_runner(model: nn.Module, tokenizer: Any, rl: RLConfig, rewards: RewardSet, weights_dir: str | os.PathLike,
                random_seed: int = 0, base_model: str | None = None) -> EpisodeRunner:
    """An episode runner drawing from the run's rollout servers (``rl.rollout_servers``)."""
    positions = model.config.max_position_embeddings
    max_prompt_len = resolve_max_prompt_len(rl, positions)
    needed = episode_max_len(rl, max_prompt_len, positions)
    if rl.environment or rl.tools:
        needed = max_prompt_len + rl.rollout_max_tokens  # multi-turn: the opening turn at least; later ones fit or end
    sampler = HttpSampler(list(rl.rollout_servers), model, tokenizer, weights_dir,
                          admin_key=rl.rollout_admin_key or os.environ.get("ASTRAI_ADMIN_KEY"),
                          api_key=os.environ.get("ASTRAI_API_KEY"), timeout=rl.rollout_timeout,
                          retries=rl.rollout_retries, needed_len=needed, transport=rl.rollout_weight_transport,
                          base_model=base_model)
    return EpisodeRunner(sampler, tokenizer, rl, rewards, max_prompt_len, random_seed)
