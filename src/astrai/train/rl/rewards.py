"""Reward functions for online RL: built-ins, user functions, a reward model, and their weighted sum.

Sits after generation in the online RL data flow: the rollout runner hands every completion,
with its prompt text and prompt record, to ``RewardSet``, which returns the weighted sum and each
function's own scores. A reward entry in the config (``rewards``) is one of:
  - a built-in name: ``exact_match`` (the completion equals the record's ``answer`` after strip),
    ``final_number`` (the last number in the completion equals the numeric ``answer``: for chat
    models that answer in sentences),
    ``format`` (1 when the completion matches ``format_pattern``), ``length`` (0 up to
    ``length_target`` characters, falling linearly to -1 at twice that), ``overlong`` (DAPO's
    soft overlong punishment over the last ``overlong_buffer`` tokens of ``rollout_max_tokens``);
  - ``module:function``, imported with the working directory on ``sys.path`` (however astrai was
    started): a per-sample function ``f(prompt, completion, record) -> float``, or a TRL-style
    one (its signature names ``prompts``, ``completions`` or ``completion_ids``, or takes only
    ``**kwargs``) called once per rollout as TRL's GRPOTrainer calls it: ``prompts``,
    ``completions`` (chat prompts: the messages, and ``[{"role": "assistant", "content": text}]``
    per completion), ``completion_ids`` and every other prompt-record column as a keyword list;
    it returns one score per completion, ``None`` for no score (it adds 0; the share of them is
    the ``<name>_none`` term). ``async def`` functions of either kind are awaited concurrently;
  - a model directory (config.json + model.safetensors with a scalar head, ``score.weight`` as
    transformers' sequence-classification models write it, or ``value_head.weight``/``.bias``):
    a reward model scored on prompt + completion in batches, the value at the last token. With
    the policy's tokenizer (or none in its directory) it reads the policy's token ids; with a
    tokenizer of its own it reads the decoded text re-encoded by that tokenizer (through its
    chat template when it has one).
Every score must be a finite number; anything else is an error naming the function and prompt.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from astrai.config import RLConfig
from astrai.data.tasks import SCORERS

RewardFn = Callable[[str, str, dict[str, Any]], float]


def answer_reward(name: str, scorer: Callable[[str, str], float]) -> RewardFn:
    """A reward that checks the completion against the record's reference ``answer``."""

    def reward(prompt: str, completion: str, record: dict[str, Any]) -> float:
        answer = record.get("answer")
        if answer is None:
            raise ValueError(f"{name} needs an 'answer' in every prompt record (or 'output' in instruction "
                             "records); add it or choose another reward")
        return scorer(completion, answer)

    reward.__name__ = name
    return reward


exact_match = answer_reward("exact_match", SCORERS["exact"])
final_number = answer_reward("final_number", SCORERS["final_number"])


def format_reward(pattern: str) -> RewardFn:
    regex = re.compile(pattern)
    return lambda prompt, completion, record: 1.0 if regex.search(completion) else 0.0


def length_reward(target: int) -> RewardFn:
    def length(prompt: str, completion: str, record: dict[str, Any]) -> float:
        over = max(0, len(completion) - target)
        return -min(1.0, over / max(target, 1))

    return length


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (eq. 13): 0 up to max_tokens - buffer tokens, then linearly
    down to -1 at max_tokens, -1 beyond."""
    start = max_tokens - buffer
    if num_tokens <= start:
        return 0.0
    return (start - num_tokens) / buffer if num_tokens <= max_tokens else -1.0


def overlong_reward(max_tokens: int, buffer: int) -> Callable[..., list[float]]:
    def overlong(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [overlong_penalty(len(ids), max_tokens, buffer) for ids in completion_ids]

    return overlong


BUILTINS: dict[str, Callable[[RLConfig], Callable[..., Any]]] = {
    "exact_match": lambda cfg: exact_match,
    "final_number": lambda cfg: final_number,
    "format": lambda cfg: format_reward(cfg.format_pattern),
    "length": lambda cfg: length_reward(cfg.length_target),
    "overlong": lambda cfg: overlong_reward(cfg.rollout_max_tokens, cfg.overlong_buffer),
}


SIGNATURE = ("f(prompt: str, completion: str, record: dict) -> float, or TRL's "
             "f(prompts, completions, completion_ids, **columns) -> list[float | None]")
TRL_ARGS = ("prompts", "completions", "completion_ids")


def is_batched(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes TRL's convention (keyword lists for the whole rollout): its signature
    names one of TRL_ARGS, or takes nothing but **kwargs."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to inspect (a builtin): the per-sample form
        return False
    if any(p.name in TRL_ARGS for p in params):
        return True
    return bool(params) and all(p.kind is p.VAR_KEYWORD for p in params)


def _user_function(spec: str) -> RewardFn:
    """Import ``module:function`` with the working directory on sys.path: the console script's
    sys.path[0] is its bin directory, not the working directory as for ``python -m astrai``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r} is not module:function; write it as mymod:fn (mymod.py in the "
                         "working directory or on PYTHONPATH, fn a function in it)")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does, so every way of starting astrai resolves alike
    importlib.invalidate_caches()  # a module written after the directory was first scanned
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"reward {spec!r}: importing module {module_name!r} failed ({e}); install what it "
                             "imports") from e
        raise ValueError(f"reward {spec!r}: no module {module_name!r} in the working directory {cwd} or on "
                         f"PYTHONPATH; run astrai from the directory that holds {module_name.replace('.', '/')}.py "
                         "or add that directory to PYTHONPATH") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                         f"attribute {attr!r}; define {SIGNATURE} named {attr} there")
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not a function (found {type(fn).__name__}); define {SIGNATURE} "
                         f"named {attr}")
    if is_batched(fn):
        return fn
    try:
        inspect.signature(fn).bind("prompt", "completion", {})
    except TypeError:
        raise ValueError(f"reward {spec!r} has the signature {attr}{inspect.signature(fn)}; a reward function is "
                         f"called as {SIGNATURE} (three positional parameters; *args works too)") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): it is checked when called
    return fn


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers give the same ids for every text and chat: the same tokenizer.json
    content (vocabulary, merges, added tokens, normalizer, pre-tokenizer) and the same chat template.
    Compared as parsed JSON, so two saves of one tokenizer are equal whatever their formatting."""
    if a is b:
        return True
    try:
        return (json.loads(a.backend.to_str()) == json.loads(b.backend.to_str())
                and a.chat_template == b.chat_template)
    except AttributeError:  # not an astrai Tokenizer: nothing to compare, so not the same
        return False


class RewardModel:
    """A scalar-head model that scores prompt + completion token ids (the value at the last token).

    ``tokenizer`` is the reward model's own when its directory has one that differs from the
    policy's (``same_tokenizer``); then ``inputs`` re-encodes the texts, else it passes the
    policy's ids through unchanged."""

    def __init__(self, path: str | Path, device: torch.device, batch_size: int = 16,
                 policy_tokenizer: Any | None = None):
        from astrai.data.tokenizer import load_tokenizer
        from astrai.model.value import ValueModel

        self.path = str(path)
        self.model = ValueModel.from_pretrained(path, device, require_head=True)
        self.model.eval().requires_grad_(False)
        self.device, self.batch_size = device, batch_size
        self.tokenizer = None
        if policy_tokenizer is not None and (Path(path) / "tokenizer.json").is_file():
            own = load_tokenizer(path)
            self.tokenizer = None if same_tokenizer(own, policy_tokenizer) else own

    def inputs(self, prompts: list[str], completions: list[str], records: list[dict[str, Any]],
               sequences: list[list[int]]) -> list[list[int]]:
        """The token ids to score: the policy's (``sequences``) with a shared tokenizer, else the
        prompt's messages + the completion as an assistant turn through this model's chat template,
        or, without a template, the decoded prompt text + completion, encoded by its tokenizer."""
        tok = self.tokenizer
        if tok is None:
            return sequences
        out = []
        for prompt, completion, record in zip(prompts, completions, records):
            messages = record.get("messages")
            if tok.chat_template and isinstance(messages, list):
                chat = [*messages, {"role": "assistant", "content": completion}]
                out.append(tok.apply_chat_template(chat, tools=record.get("tools")))
            else:
                out.append(tok.encode(prompt + completion))
        return out

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[float]:
        vocab_size = self.model.config.vocab_size
        too_big = max((i for r in sequences for i in r), default=0)
        if too_big >= vocab_size:
            raise ValueError(f"reward model {self.path} has vocab_size {vocab_size} but was given token id {too_big}; "
                             "put the tokenizer it was trained with (tokenizer.json) in its directory")
        out: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            rows = sequences[start:start + self.batch_size]
            T = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), T, dtype=torch.long)
            mask = torch.zeros(len(rows), T, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r)
                mask[i, :len(r)] = 1
            values = self.model(ids.to(self.device), attention_mask=mask.to(self.device))  # (b, T)
            last = mask.sum(dim=1) - 1  # (b,)
            out += values[torch.arange(len(rows)), last.to(self.device)].tolist()
        return out


class RewardSet:
    """The configured rewards and weights: ``__call__`` scores a rollout's completions."""

    def __init__(self, cfg: RLConfig, device: torch.device | None = None, tokenizer: Any | None = None):
        """`tokenizer` is the policy's: a reward model with a different one re-encodes the texts;
        None keeps the policy's ids for every reward model."""
        self.names = list(cfg.rewards)
        self.weights = list(cfg.reward_weights) if cfg.reward_weights is not None else [1.0] * len(self.names)
        self.functions: list[RewardFn | RewardModel] = []
        for name in self.names:
            if name in BUILTINS:
                self.functions.append(BUILTINS[name](cfg))
            elif (Path(name) / "config.json").is_file():
                self.functions.append(RewardModel(name, device or torch.device("cpu"),
                                                   policy_tokenizer=tokenizer))
            elif ":" in name:
                self.functions.append(_user_function(name))
            else:
                raise ValueError(f"unknown reward {name!r}; use one of {', '.join(BUILTINS)}, module:function, "
                                 "or a reward model directory")

    def __call__(self, prompts: list[str], completions: list[str], records: list[dict[str, Any]],
                 sequences: list[list[int]], group_size: int,
                 completion_ids: list[list[int]] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted sum (N,), {name: scores (N,)}) for N completions; completion i belongs to
        prompt i // group_size (used in error messages). `completion_ids`: each completion's token
        ids, for TRL-style functions and ``overlong``. A TRL-style user function adds the term
        ``<name>_none``: 1 where it returned None (its score there is 0)."""
        raw: dict[str, Any] = {}
        for name, fn in zip(self.names, self.functions):
            if isinstance(fn, RewardModel):
                raw[name] = fn.score(fn.inputs(prompts, completions, records, sequences))
            elif is_batched(fn):
                raw[name] = fn(**_trl_kwargs(name, fn, prompts, completions, records, completion_ids))
            else:
                raw[name] = [fn(p, c, r) for p, c, r in zip(prompts, completions, records)]
                if any(inspect.isawaitable(v) for v in raw[name]):
                    raw[name] = _all(raw[name])
        raw = _awaited(raw)
        per_fn: dict[str, torch.Tensor] = {}
        for name, fn in zip(self.names, self.functions):
            scores = raw[name]
            if name not in BUILTINS and not isinstance(fn, RewardModel) and is_batched(fn):
                # TRL turns None into NaN and sums with nansum: no score adds 0; counted, not hidden
                none = [v is None for v in scores] if isinstance(scores, list | tuple) else []
                scores = [0.0 if v is None else v for v in scores] if none else scores
                per_fn[name] = _checked(name, scores, len(completions), group_size)
                per_fn[f"{name}_none"] = torch.tensor(none, dtype=torch.float32)
            else:
                per_fn[name] = _checked(name, scores, len(completions), group_size)
        total = sum(w * per_fn[n] for n, w in zip(self.names, self.weights))
        return total, per_fn


def _trl_kwargs(name: str, fn: Callable[..., Any], prompts: list[str], completions: list[str],
                records: list[dict[str, Any]], completion_ids: list[list[int]] | None) -> dict[str, Any]:
    """The keyword lists TRL's GRPOTrainer passes a reward function: chat prompts (a ``messages``
    list in every record) as their messages with one assistant message per completion, plain
    strings otherwise; the token ids; every other record column (``answer``, metadata fields)."""
    if completion_ids is None:
        raise ValueError(f"reward {name!r} takes TRL's arguments, which include completion_ids; pass "
                         "completion_ids= (each completion's token ids) to RewardSet, as the rollout runner does")
    chat = all(isinstance(r.get("messages"), list) for r in records)
    columns = dict.fromkeys(k for r in records for k in r if k != "messages" and k not in TRL_ARGS)
    kwargs = {"prompts": [r["messages"] for r in records] if chat else list(prompts),
              "completions": [[{"role": "assistant", "content": c}] for c in completions] if chat else list(completions),
              "completion_ids": [list(ids) for ids in completion_ids],
              **{k: [r.get(k) for r in records] for k in columns}}
    params = inspect.signature(fn).parameters
    for p in params.values():
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs:
            raise ValueError(f"reward {name!r} needs the column {p.name!r} in every prompt record (top level or "
                             f"under metadata); the records have {', '.join(columns) or 'no other columns'}")
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}  # TRL's functions take **kwargs; be lenient
    return kwargs


async def _all(awaitables: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*awaitables))


def _awaited(raw: dict[str, Any]) -> dict[str, Any]:
    """The scores with every awaitable awaited together, so async reward functions run concurrently."""
    pending = {k: v for k, v in raw.items() if inspect.isawaitable(v)}
    if not pending:
        return raw

    async def gather() -> dict[str, Any]:
        return dict(zip(pending, await asyncio.gather(*pending.values())))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return {**raw, **asyncio.run(gather())}
    with ThreadPoolExecutor(1) as pool:  # called inside a running loop (a notebook): run one of its own
        return {**raw, **pool.submit(asyncio.run, gather()).result()}


def _checked(name: str, scores: Any, expected: int, group_size: int) -> torch.Tensor:
    if not isinstance(scores, list | tuple) or len(scores) != expected:
        got = len(scores) if hasattr(scores, "__len__") else type(scores).__name__
        raise ValueError(f"reward {name!r} returned {got} scores for {expected} completions; return one float "
                         "per completion")
    for i, value in enumerate(scores):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"reward {name!r} gave {value!r} for completion {i % group_size} of prompt "
                             f"{i // group_size}; a reward must be a finite number")
    return torch.tensor([float(v) for v in scores], dtype=torch.float32)
