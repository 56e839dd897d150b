"""Multi-turn episodes for online RL: environments, tools, and the token row the loss sees.

``rl.environment: module:Class`` (resolved like user rewards, from the working directory) is
constructed with no arguments once per sample: every episode has its own instance, so state kept
on ``self`` belongs to one conversation. ``reset(record) -> list[message]`` opens the episode (no
``reset``: the record's messages); ``step(messages) -> EnvStep`` is called after each assistant
turn that calls no tool, with the whole conversation; its messages are appended, its reward
added to the episode's, and ``done`` ends it. Either method may be ``async def``: the episodes of
a rollout are awaited together. ``rl.tools`` (and an environment's ``tools`` attribute) are
offered through the chat template (``rl/tools.py``); a turn with tool calls gets their results
as ``tool`` messages and the model goes on. Without an environment an episode ends at the first
turn that calls no tool. At most ``max_turns`` assistant turns: an episode that would go on, or
whose next turn no longer fits the model's positions, ends truncated (counted).

The training row is built by concatenation, never by re-rendering: the first prompt's ids, then
per turn the ids the model sampled (labels and behaviour log-probs), then the ids of what came
between turns (the end of the assistant turn the model did not sample, the tool and environment
messages, the next generation prompt: no labels). Each turn's prompt is the row so far, so the
engine's prefix cache serves the earlier turns' KV (same policy version within a rollout), and
the trainer's log-probs are taken on exactly the ids the sampler saw. Assistant messages hold
the model's text as sampled (tool-call blocks included), so the final conversation renders to
the row's text.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astrai.data.tasks import multiply
from astrai.train.rl.tools import ToolBox
from astrai.train.rl.user_code import import_user_object

Message = dict[str, Any]


@dataclass
class EnvStep:
    """An environment's answer to an assistant turn."""

    messages: list[Message] | None = None  # appended to the conversation (e.g. a user follow-up)
    reward: float | None = None  # added to the episode's reward
    done: bool = False


@dataclass
class Episode:
    """One sample's conversation and the row the loss sees."""

    record: dict[str, Any]
    prompt_index: int  # the group (prompt) it belongs to
    sample: int  # its index within the group
    env: Any
    tools: ToolBox
    messages: list[Message] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the row: every token so far
    logps: list[float | None] = field(default_factory=list)  # the sampler's log-prob of a sampled token, else None
    num_prompt_ids: int = 0  # the opening prompt's length
    reward: float = 0.0  # the environment's rewards, summed
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_prefill_tokens: int = 0  # prompt tokens the engine computed (not served from the prefix cache)
    num_prompt_tokens: int = 0  # prompt tokens sent over all turns (what a re-prefill per turn would cost)
    final_text: str = ""  # the last assistant turn's text (the configured rewards score it)
    final_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # the last turn's
    ended_with: str = ""  # the text of the stop token that ended the last turn ("" when cut off)
    done: bool = False
    truncated: bool = False  # ended by max_turns or the model's positions, not by the episode itself

    @property
    def finished(self) -> bool:
        return self.done or self.truncated


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class CalculatorEnv:
    """The built-in example (``rl.environment: astrai.train.rl.environments:CalculatorEnv``):
    arithmetic prompts with a ``multiply`` tool (``astrai.data.tasks``); the episode ends at the
    first turn that calls no tool, its answer scored by the configured rewards (``exact_match``).
    ``tool_trace_record`` writes SFT traces of the same conversations."""

    tools = [multiply]

    def step(self, messages: list[Message]) -> EnvStep:
        return EnvStep(done=True)


def environment_class(spec: str) -> type:
    cls = import_user_object(spec, "environment", "a class with reset(record) and step(messages)")
    if not callable(getattr(cls, "step", None)):
        raise ValueError(f"environment {spec!r} ({getattr(cls, '__name__', cls)!r}) has no step(messages) method; "
                         "define step(self, messages) -> EnvStep on it")
    return cls


def tool_functions(specs: list[str]) -> list[Callable[..., Any]]:
    functions = []
    for spec in specs:
        fn = import_user_object(spec, "tool", "a function with type hints and a docstring")
        if not callable(fn):
            raise ValueError(f"tool {spec!r} is not a function (found {type(fn).__name__}); name a function")
        functions.append(fn)
    return functions


class MultiTurn:
    """Runs a rollout's episodes turn by turn; `generate` (from ``rl/rollout.py``) samples one
    turn of the given episodes on the engine and returns (completion, prefill tokens) each."""

    def __init__(self, tokenizer: Any, environment: str | None, tools: list[str], max_turns: int,
                 max_tokens: int, max_model_len: int):
        self.tokenizer, self.max_turns, self.max_tokens, self.max_model_len = tokenizer, max_turns, max_tokens, max_model_len
        self.env_cls = environment_class(environment) if environment else None
        self.functions = tool_functions(tools)
        ToolBox(self.functions)  # names and schemas checked at start, not at the first rollout
        self.closing = self._closing_text()
        self.stats = {"tool_seconds": 0.0, "env_seconds": 0.0}

    def _closing_text(self) -> str:
        """What the template writes after an assistant's content (ChatML: ``<|im_end|>\\n``)."""
        sentinel = "\x00sentinel\x00"
        text = self.tokenizer.render_chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": sentinel}])
        return text.split(sentinel, 1)[-1]

    def open(self, records: list[dict[str, Any]], group_size: int) -> list[Episode]:
        """One episode per sample (group_size per record), each with its own environment
        instance, reset concurrently; the opening prompt rendered with the episode's tools."""
        episodes = []
        for i, record in enumerate(records):
            for g in range(group_size):
                env = self.env_cls() if self.env_cls else None
                extra = list(getattr(env, "tools", None) or [])
                episodes.append(Episode(record, i, g, env, ToolBox(self.functions + extra)))

        async def reset(e: Episode) -> list[Message]:
            if e.env is not None and callable(getattr(e.env, "reset", None)):
                return await _env_call(e, "reset", e.record)
            return e.record["messages"]

        start = time.perf_counter()
        opened = asyncio.run(_gather([reset(e) for e in episodes]))
        self.stats["env_seconds"] += time.perf_counter() - start
        for e, messages in zip(episodes, opened):
            e.messages = [dict(m) for m in messages]
            e.ids = self.tokenizer.encode(self._render(e, e.messages, add_generation_prompt=True))
            e.logps = [None] * len(e.ids)
            e.num_prompt_ids = len(e.ids)
        return episodes

    def _render(self, e: Episode, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                          tools=e.tools.schemas or None)

    def run(self, episodes: list[Episode], generate: Callable[[list[Episode], int], list[tuple[Any, int]]]) -> None:
        """Every episode to its end: per turn, sample all unfinished ones together, then run their
        tools and environment steps concurrently, then extend their rows to the next prompt."""
        for turn in range(self.max_turns):
            active = [e for e in episodes if not e.finished]
            if not active:
                return
            for e, (completion, num_prefill) in zip(active, generate(active, turn)):
                self._add_turn(e, completion, num_prefill)
            asyncio.run(_gather([self._after_turn(e) for e in active]))
            for e in active:
                if not e.done and turn + 1 == self.max_turns:
                    e.truncated = True  # it would go on: running past max_turns
                elif not e.done:
                    self._extend_to_next_prompt(e)

    def _add_turn(self, e: Episode, completion: Any, num_prefill: int) -> None:
        token_ids = list(completion.token_ids)
        if len(completion.logprobs or []) != len(token_ids):
            raise ValueError(f"a turn of {len(token_ids)} tokens came with {len(completion.logprobs or [])} "
                             "behaviour log-probs; rollouts need return_logprobs=True")
        e.num_prompt_tokens += len(e.ids)
        e.num_prefill_tokens += num_prefill
        e.ids += token_ids
        e.logps += [float(lp) for lp in completion.logprobs]
        e.num_turns += 1
        e.final_text, e.final_ids, e.finish_reason = completion.text, token_ids, completion.finish_reason
        stop = token_ids[-1:] if token_ids and token_ids[-1] in self.tokenizer.stop_token_ids else []
        e.messages.append({"role": "assistant", "content": self.tokenizer.decode(
            token_ids[:len(token_ids) - len(stop)], skip_special_tokens=False)})
        e.ended_with = self.tokenizer.decode(stop, skip_special_tokens=False)  # the closing the model sampled

    async def _after_turn(self, e: Episode) -> None:
        """The turn's tool calls, run (results as tool messages); a turn without any goes to the
        environment (no environment: the episode is done)."""
        calls = e.tools.parse(e.messages[-1]["content"])
        if calls:
            start = time.perf_counter()
            for call in calls:
                content, error = await e.tools.call(call)
                e.messages.append({"role": "tool", "name": call.name, "content": content})
                e.num_tool_calls += 1
                e.num_tool_errors += int(error)
            self.stats["tool_seconds"] += time.perf_counter() - start
            return
        if e.env is None:
            e.done = True
            return
        start = time.perf_counter()
        result = await _env_call(e, "step", [dict(m) for m in e.messages])
        self.stats["env_seconds"] += time.perf_counter() - start
        if not isinstance(result, EnvStep):
            raise TypeError(f"environment {type(e.env).__name__}.step returned {type(result).__name__}, not an EnvStep; "
                            "return EnvStep(messages=..., reward=..., done=...)")
        e.messages += [dict(m) for m in result.messages or []]
        e.reward += float(result.reward or 0.0)
        e.done = bool(result.done)

    def _extend_to_next_prompt(self, e: Episode) -> None:
        """The ids between this turn's last sampled token and the next turn's first: the rest of
        the assistant turn's closing, the new messages, the generation prompt (no labels)."""
        assistant_at = max(i for i, m in enumerate(e.messages) if m["role"] == "assistant")
        before = self._render(e, e.messages[:assistant_at + 1])
        after = self._render(e, e.messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template is not prefix-preserving across turns: the conversation rendered "
                             f"after turn {e.num_turns} does not start with its rendering up to that turn "
                             f"({before[-80:]!r}); multi-turn rollouts need a template whose earlier turns render "
                             "the same whatever follows them")
        closing = self.closing[len(e.ended_with):] if self.closing.startswith(e.ended_with) else self.closing
        delta = self.tokenizer.encode(closing + after[len(before):])
        if len(e.ids) + len(delta) + self.max_tokens > self.max_model_len:
            e.truncated = True  # the next turn would run past the model's positions: the row ends here
            return
        e.ids += delta
        e.logps += [None] * len(delta)


async def _env_call(e: Episode, method: str, arg: Any) -> Any:
    """An environment method, awaited if async; whatever it raises is one line naming the
    environment, the method and the episode (the run stops: an environment bug is not a score)."""
    try:
        return await _maybe_await(getattr(e.env, method)(arg))
    except Exception as exc:
        raise ValueError(f"environment {type(e.env).__name__}.{method} raised {type(exc).__name__}: {exc} (prompt "
                         f"{e.prompt_index}, sample {e.sample}, after {e.num_turns} turn(s)); fix the environment "
                         "(a tool's errors go to the model, an environment's stop the run)") from exc


async def _gather(awaitables: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*awaitables))


def episode_stats(episodes: list[Episode], tool_seconds: float, env_seconds: float) -> dict[str, float]:
    """A rollout's multi-turn metrics (per-episode means; counts summed over the rollout)."""
    n = max(len(episodes), 1)
    return {"turns_per_episode": sum(e.num_turns for e in episodes) / n,
            "tool_calls_per_episode": sum(e.num_tool_calls for e in episodes) / n,
            "tool_use_rate": sum(e.num_tool_calls > 0 for e in episodes) / n,  # episodes with a tool call
            "tool_errors": float(sum(e.num_tool_errors for e in episodes)),
            "truncated_episodes": float(sum(e.truncated for e in episodes)),
            "prefill_tokens_per_episode": sum(e.num_prefill_tokens for e in episodes) / n,
            "prompt_tokens_per_episode": sum(e.num_prompt_tokens for e in episodes) / n,
            "tool_seconds": tool_seconds, "env_seconds": env_seconds}
