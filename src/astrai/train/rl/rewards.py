"""Reward functions for online RL: built-ins, user functions, a reward model, and their weighted sum.

Sits after generation in the online RL data flow: the rollout runner hands every completion,
with its prompt text and prompt record, to ``RewardSet``, which returns the weighted sum and each
function's own scores. A reward entry in the config (``rewards``) is one of:
  - a built-in name: ``exact_match`` (the completion equals the record's ``answer`` after strip),
    ``final_number`` (the last number in the completion equals the numeric ``answer``: for chat
    models that answer in sentences),
    ``format`` (1 when the completion matches ``format_pattern``), ``length`` (0 up to
    ``length_target`` characters, falling linearly to -1 at twice that), ``overlong`` (DAPO's
    soft overlong punishment over the last ``overlong_buffer`` tokens of ``rollout_max_tokens``),
    ``judge`` (an LLM judge behind an OpenAI-compatible chat endpoint, ``rl/judge.py``; a completion
    it cannot score gets None, counted in the ``judge_failures`` term);
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
Every score must be a number finite in float32 (Python, numpy or 0-d torch scalars); anything
else is an error naming the function and prompt. User functions run on a worker thread, each call
bounded by ``reward_timeout`` and interrupted by a stop request (``RewardSet``); whatever they
raise, ``sys.exit`` included, is one error line naming the function and the prompt.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from astrai.config import RLConfig
from astrai.data.tasks import SCORERS
from astrai.model.lora import is_adapter_dir
from astrai.model.manifest import resolve_model_dir
from astrai.train.rl.guard import call_in_worker, outcome
from astrai.train.rl.judge import Judge
from astrai.train.rl.reward_model import RewardModel
from astrai.train.rl.user_code import import_user_object

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
    "judge": Judge,
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
    """A user reward ``module:function``, its signature checked (per sample or TRL-style batched)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r} is not module:function; write it as mymod:fn (mymod.py in the "
                         "working directory or on PYTHONPATH, fn a function in it)")
    fn = import_user_object(spec, "reward", SIGNATURE)
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


class RewardSet:
    """The configured rewards and weights: ``__call__`` scores a rollout's completions.

    User functions (``module:function``) run on a worker thread, one call at a time, while the
    caller waits in short slices: a call longer than ``reward_timeout`` seconds is an error naming
    the function and the prompt, and ``should_stop()`` turning true (a SIGTERM's stop request)
    raises ``UserCodeInterrupted`` within a slice. Whatever a function raises, ``SystemExit`` and
    ``KeyboardInterrupt`` from inside it included, is one ``ValueError`` naming it and the prompt.
    A thread that never returns is left behind as a daemon: it cannot keep the process alive."""

    def __init__(self, cfg: RLConfig, device: torch.device | None = None, tokenizer: Any | None = None,
                 should_stop: Callable[[], bool] | None = None):
        """`tokenizer` is the policy's: a reward model with a different one re-encodes the texts;
        None keeps the policy's ids for every reward model. `should_stop`: polled while a user
        function runs (the loop's stop request)."""
        self.names = list(cfg.rewards)
        self.weights = list(cfg.reward_weights) if cfg.reward_weights is not None else [1.0] * len(self.names)
        for i, (name, weight) in enumerate(zip(self.names, self.weights)):
            if finite_number(weight) is None:
                raise ValueError(f"reward_weights[{i}]={weight!r} (the weight of reward {name!r}) is not a number "
                                 f"finite in float32 (|w| <= {F32_MAX:.3g}); give a finite weight")
        self.timeout, self.should_stop = float(cfg.reward_timeout), should_stop
        self.functions: list[RewardFn | RewardModel] = []
        for name in self.names:
            if name in BUILTINS:
                self.functions.append(BUILTINS[name](cfg))
            elif Path(name).is_dir() and ((resolve_model_dir(name) / "config.json").is_file()
                                          or is_adapter_dir(resolve_model_dir(name))):
                # a reward model directory (a LoRA run's: its adapter), or a reward run's ckpt_dir
                # (its newest checkpoint)
                self.functions.append(RewardModel(resolve_model_dir(name), device or torch.device("cpu"),
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
        raw = self._raw_scores(prompts, completions, records, sequences, group_size, completion_ids)
        per_fn: dict[str, torch.Tensor] = {}
        for name, fn in zip(self.names, self.functions):
            scores = raw[name]
            none_term = getattr(fn, "none_term", None)  # a built-in that may give no score (judge)
            if none_term or (name not in BUILTINS and not isinstance(fn, RewardModel) and is_batched(fn)):
                # TRL turns None into NaN and sums with nansum: no score adds 0; counted, not hidden
                scores = _as_list(scores)
                none = [v is None for v in scores] if isinstance(scores, list) else []
                scores = [0.0 if v is None else v for v in scores] if none else scores
                per_fn[name] = _checked(name, scores, len(completions), group_size)
                per_fn[none_term or f"{name}_none"] = torch.tensor(none, dtype=torch.float32)
            else:
                per_fn[name] = _checked(name, scores, len(completions), group_size)
        total = sum((w * per_fn[n].double() for n, w in zip(self.names, self.weights)),
                    torch.zeros(len(completions), dtype=torch.float64))  # no rewards (pure distillation): 0
        bad = (~torch.isfinite(total) | (total.abs() > F32_MAX)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"the weighted sum of rewards {self.names} with reward_weights {self.weights} is "
                             f"{float(total[i]):g} for completion {i % group_size} of prompt {i // group_size}, "
                             "not finite in float32; lower the weights or the scores")
        return total.float(), per_fn

    def _raw_scores(self, prompts: list[str], completions: list[str], records: list[dict[str, Any]],
                    sequences: list[list[int]], group_size: int,
                    completion_ids: list[list[int]] | None) -> dict[str, Any]:
        """Each function's scores as it returned them; user functions guarded, awaitables awaited
        together at the end (async functions run concurrently)."""
        raw: dict[str, Any] = {}
        pending: list[tuple[str, int | None, Any]] = []  # (name, sample index or None, awaitable)
        try:
            for name, fn in zip(self.names, self.functions):
                if isinstance(fn, RewardModel):
                    raw[name] = fn.score(fn.inputs(prompts, completions, records, sequences))
                elif name in BUILTINS:  # ours: called directly
                    raw[name] = fn(**_trl_kwargs(name, fn, prompts, completions, records, completion_ids)) \
                        if is_batched(fn) else [fn(p, c, r) for p, c, r in zip(prompts, completions, records)]
                elif is_batched(fn):
                    kwargs = _trl_kwargs(name, fn, prompts, completions, records, completion_ids)
                    whole = self._guarded(name, [partial(fn, **kwargs)], lambda i: _batch_where(len(prompts), group_size))
                    raw[name] = whole[0]
                    if inspect.isawaitable(raw[name]):
                        pending.append((name, None, raw[name]))
                else:
                    calls = [partial(fn, *args) for args in zip(prompts, completions, records)]
                    raw[name] = self._guarded(name, calls, lambda i: _where(i, group_size))
                    pending += [(name, i, v) for i, v in enumerate(raw[name]) if inspect.isawaitable(v)]
            if pending:
                self._await_all(pending, raw, len(prompts), group_size)
        finally:
            for _, _, awaitable in pending:  # an error before awaiting them: no never-awaited warnings
                getattr(awaitable, "close", lambda: None)()
        return raw

    def _guarded(self, name: str, calls: list[Callable[[], Any]], where: Callable[[int], str]) -> list[Any]:
        """The results of `calls` to user function `name`, each bounded by reward_timeout, on a
        worker thread; a failure names the function and, through `where`, the call's prompt."""
        kind, value, index = call_in_worker(calls, self.timeout, self.should_stop)
        return outcome(name, where(index), kind, value, self.timeout)

    def _await_all(self, pending: list[tuple[str, int | None, Any]], raw: dict[str, Any], num: int,
                   group_size: int) -> None:
        """Await every awaitable concurrently on one event loop of a worker thread, each bounded by
        ``reward_timeout``; results go back into `raw`, the first failure is raised."""
        timeout = self.timeout
        outcomes: list[tuple[str, Any] | None] = [None] * len(pending)

        async def one(k: int, awaitable: Any) -> None:
            try:
                outcomes[k] = ("value", await (asyncio.wait_for(awaitable, timeout) if timeout > 0 else awaitable))
            except TimeoutError:
                outcomes[k] = ("timeout", None)
            except BaseException as e:  # one line naming the reward, whatever it raised
                outcomes[k] = ("error", e)

        async def gather() -> None:
            await asyncio.gather(*(one(k, aw) for k, (_, _, aw) in enumerate(pending)))

        def where(k: int) -> str:
            index = pending[k][1]
            return _batch_where(num, group_size) if index is None else _where(index, group_size)

        # the outer bound (one slice of slack) catches a coroutine that blocks its event loop outright
        kind, value, _ = call_in_worker([lambda: asyncio.run(gather())], timeout + 1.0 if timeout > 0 else 0.0,
                                        self.should_stop)
        if kind != "value":  # name the first one still running
            k = next((k for k, o in enumerate(outcomes) if o is None), 0)
            outcome(pending[k][0], where(k), kind, value, timeout)
        for k, (name, index, _) in enumerate(pending):
            result = outcome(name, where(k), *outcomes[k], timeout)
            if index is None:
                raw[name] = result
            else:
                raw[name][index] = result
        pending.clear()  # all awaited


F32_MAX = float(torch.finfo(torch.float32).max)


def _where(index: int, group_size: int) -> str:
    return f"completion {index % group_size} of prompt {index // group_size}"


def _batch_where(num: int, group_size: int) -> str:
    return f"its one call for the rollout's {num // max(group_size, 1)} prompts ({num} completions)"


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


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a number finite in float32: Python, numpy and 0-d torch
    scalars (bools count as 0 / 1); None otherwise."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.dim() == 0 else None
    elif isinstance(value, np.generic):
        value = value.item()
    if not isinstance(value, bool | int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float64
        return None
    return number if math.isfinite(number) and abs(number) <= F32_MAX else None


def _as_list(scores: Any) -> Any:
    """A batched function's scores: a 1-d tensor or array is taken as its list of values."""
    if isinstance(scores, torch.Tensor | np.ndarray) and scores.ndim == 1:
        return list(scores)
    return scores


def _checked(name: str, scores: Any, expected: int, group_size: int) -> torch.Tensor:
    scores = _as_list(scores)
    if not isinstance(scores, list | tuple) or len(scores) != expected:
        got = len(scores) if hasattr(scores, "__len__") else type(scores).__name__
        raise ValueError(f"reward {name!r} returned {got} scores for {expected} completions; return one float "
                         "per completion")
    numbers = [finite_number(v) for v in scores]
    for i, (value, number) in enumerate(zip(scores, numbers)):
        if number is None:
            raise ValueError(f"reward {name!r} gave {value!r} for {_where(i, group_size)}; a reward must be a "
                             f"number finite in float32 (|r| <= {F32_MAX:.3g})")
    return torch.tensor(numbers, dtype=torch.float32)
