"""An episode: one sample's conversation, the token row the loss sees, and how a turn extends it.

The episode runner (``rl/runner.py``) owns the turn loop; this module holds what one episode
goes through inside it: ``Conversation.open`` (the environment's ``reset``, the opening prompt
rendered with the episode's tools), ``add_turn`` (the sampled tokens and their behaviour log-probs),
``after_turn`` (the turn's tool calls run, or else the environment's ``step``: the hooks of
``rl/environments.py`` and ``rl/tools.py``) and ``extend_to_next_prompt``. A single-turn rollout
is the case without tools or an environment: the opening prompt is the record's own ids and the
episode is done after its first turn.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astrai.train.rl.environments import (
    Message,
    checked_messages,
    checked_step,
    env_call,
    environment_class,
    tool_functions,
)
from astrai.train.rl.guard import UserHooks
from astrai.train.rl.sampler import SampledTurn
from astrai.train.rl.tools import ToolBox


@dataclass
class Episode:
    """One sample's conversation and the row the loss sees."""

    record: dict[str, Any]
    prompt_index: int  # the group (prompt) it belongs to
    sample: int  # its index within the group
    draw: int  # which of the runner's draws it belongs to (their sampling and seeds differ)
    env: Any
    tools: ToolBox
    messages: list[Message] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the row: every token so far
    logps: list[float | None] = field(default_factory=list)  # the sampler's log-prob of a sampled token, else None
    num_prompt_ids: int = 0  # the opening prompt's length
    reward: float = 0.0  # the environment's rewards, summed
    # (row position of the turn's last sampled token, the environment's reward for that turn), per step
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0  # tool calls answered with an error message (timeouts included)
    num_tool_timeouts: int = 0  # tool calls abandoned at tool_timeout
    num_prefill_tokens: int = 0  # prompt tokens the sampler computed (not served from the prefix cache)
    num_prompt_tokens: int = 0  # prompt tokens sent over all turns (what a re-prefill per turn would cost)
    final_text: str = ""  # the last assistant turn's text (the configured rewards score it)
    final_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # the last turn's
    ended_with: str = ""  # the text of the stop token that ended the last turn ("" when cut off)
    done: bool = False
    truncated: bool = False  # ended by max_turns or the model's positions, not by the episode itself
    # routing_replay: the experts (tokens, MoE layers, k) the sampler routed the row's tokens to, from
    # the latest turn (whose prompt was the whole row so far): every token but the last sampled one
    routing: Any = None

    @property
    def finished(self) -> bool:
        return self.done or self.truncated

    def where(self) -> str:
        """The episode, for an error line."""
        return f"prompt {self.prompt_index}, sample {self.sample}, after {self.num_turns} turn(s)"


class Conversation:
    """How every episode of a run opens and moves from turn to turn: its environment class, tool
    functions and chat template; `max_tokens` and `max_model_len` bound the row. The tools and the
    environment run through `UserHooks` (``rl/guard.py``): each call bounded by `tool_timeout` or
    `env_timeout` seconds (0 = no limit), a turn abandoned when `should_stop()` turns true."""

    def __init__(self, tokenizer: Any, environment: str | None, tools: list[str], max_tokens: int,
                 max_model_len: int, tool_timeout: float = 0.0, env_timeout: float = 0.0,
                 should_stop: Callable[[], bool] | None = None):
        self.tokenizer, self.max_tokens, self.max_model_len = tokenizer, max_tokens, max_model_len
        self.tool_timeout, self.env_timeout = tool_timeout, env_timeout
        self.hooks = UserHooks(should_stop)
        self.env_cls = environment_class(environment) if environment else None
        self.functions = tool_functions(tools)
        self.multi_turn = self.env_cls is not None or bool(self.functions)
        ToolBox(self.functions)  # names and schemas checked at start, not at the first rollout
        self.closing = self._closing_text() if self.multi_turn else ""
        # no token covers more characters than the vocabulary's longest (a byte-level token's bytes)
        self.max_token_chars = (max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)
                                if self.multi_turn else 1)
        self.stats = {"tool_seconds": 0.0, "env_seconds": 0.0}

    def _closing_text(self) -> str:
        """What the template writes after an assistant's content (ChatML: ``<|im_end|>\\n``)."""
        sentinel = "\x00sentinel\x00"
        text = self.tokenizer.render_chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": sentinel}])
        return text.split(sentinel, 1)[-1]

    def open(self, records: list[dict[str, Any]], prompt_ids: list[list[int]], group_size: int,
             draw: int = 0) -> list[Episode]:
        """One episode per sample (group_size per record), each with its own environment
        instance, made and reset concurrently. Multi-turn: the opening prompt is the (reset)
        conversation rendered with the episode's tools; single-turn: the record's `prompt_ids` as given."""
        episodes = [Episode(record, i, g, draw, None, ToolBox(self.functions))
                    for i, record in enumerate(records) for g in range(group_size)]
        start = time.perf_counter()
        opened = (self.hooks.run(lambda: gather([self._start(e) for e in episodes])) if self.env_cls
                  else [e.record["messages"] for e in episodes])
        self.stats["env_seconds"] += time.perf_counter() - start
        for e, messages in zip(episodes, opened):
            e.messages = [dict(m) for m in messages]
            e.ids = (self.tokenizer.encode(self._render(e, e.messages, add_generation_prompt=True, after=self._opener(e)))
                     if self.multi_turn else list(prompt_ids[e.prompt_index]))
            e.logps = [None] * len(e.ids)
            e.num_prompt_ids = len(e.ids)
        return episodes

    async def _start(self, e: Episode) -> list[Message]:
        """The episode's environment instance (its own tools added) and its opening messages."""
        e.env = await env_call(self.hooks, self.env_cls, "__init__", (), e.where(), self.env_timeout)
        if extra := list(getattr(e.env, "tools", None) or []):
            e.tools = ToolBox(self.functions + extra)
        if callable(getattr(e.env, "reset", None)):
            opened = await env_call(self.hooks, e.env, "reset", (e.record,), e.where(), self.env_timeout)
            return checked_messages(opened, self._opener(e), e.where(), empty_ok=False)
        return e.record["messages"]

    def _opener(self, e: Episode) -> str:
        """Where an episode's opening messages came from, for an error line."""
        reset = e.env is not None and callable(getattr(e.env, "reset", None))
        return f"environment {type(e.env).__name__}.reset" if reset else "the prompt record"

    def _render(self, e: Episode, messages: list[Message], add_generation_prompt: bool = False,
                after: str = "") -> str:
        """The conversation as the chat template writes it; with `after` (where the last messages came
        from), a template error (an unknown role) is one line naming it and the episode."""
        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                              tools=e.tools.schemas or None)
        except Exception as exc:  # jinja's errors, and whatever the template raises
            if not after:
                raise
            raise ValueError(f"the chat template cannot render the messages of {after} ({e.where()}): "
                             f"{' '.join(str(exc).split())}; return messages the template accepts") from exc

    def add_turn(self, e: Episode, completion: SampledTurn, num_prefill: int, logprobs: bool = True) -> None:
        """The turn's sampled tokens onto the row (with their behaviour log-probs when `logprobs`)."""
        token_ids = list(completion.token_ids)
        if logprobs and len(completion.logprobs) != len(token_ids):
            raise ValueError(f"a turn of {len(token_ids)} tokens came with {len(completion.logprobs)} "
                             "behaviour log-probs; rollouts need the sampler's log-prob of every token")
        e.num_prompt_tokens += len(e.ids)
        e.num_prefill_tokens += num_prefill
        e.ids += token_ids
        e.logps += [float(lp) for lp in completion.logprobs] if logprobs else [0.0] * len(token_ids)
        if completion.routing is not None:
            e.routing = completion.routing
        e.num_turns += 1
        e.final_text, e.final_ids, e.finish_reason = completion.text, token_ids, completion.finish_reason
        if not self.multi_turn:
            return  # nothing reads the conversation of a single-turn episode
        stop = token_ids[-1:] if token_ids and token_ids[-1] in self.tokenizer.stop_token_ids else []
        e.messages.append({"role": "assistant", "content": self.tokenizer.decode(
            token_ids[:len(token_ids) - len(stop)], skip_special_tokens=False)})
        e.ended_with = self.tokenizer.decode(stop, skip_special_tokens=False)  # the closing the model sampled

    def after_turns(self, episodes: list[Episode]) -> None:
        """Every episode's `after_turn`, concurrently: one turn of user code, guarded (class docstring)."""
        if not self.multi_turn:
            for e in episodes:
                e.done = True  # no tools, no environment: one turn
            return
        # the episodes' calls overlap, so their own spans add up to more than the phase took: the
        # phase's wall time is what `tool_seconds` and `env_seconds` get, split as the spans were
        busy = {"tool_seconds": 0.0, "env_seconds": 0.0}
        start = time.perf_counter()
        self.hooks.run(lambda: gather([self.after_turn(e, busy) for e in episodes]))
        wall, spans = time.perf_counter() - start, sum(busy.values())
        for key, seconds in busy.items():
            self.stats[key] += wall * seconds / spans if spans > 0 else 0.0

    async def after_turn(self, e: Episode, busy: dict[str, float]) -> None:
        """The turn's tool calls, run one after another (results as tool messages); a turn without
        any goes to the environment (no environment: the episode is done). Their seconds are added
        to `busy` (``tool_seconds`` or ``env_seconds``)."""
        calls = e.tools.parse(e.messages[-1]["content"]) if e.tools else []
        if calls:
            start = time.perf_counter()
            for call in calls:
                content, outcome = await e.tools.call(call, self.hooks, self.tool_timeout)
                e.messages.append({"role": "tool", "name": call.name, "content": self._bounded(e, content)})
                e.num_tool_calls += 1
                e.num_tool_errors += outcome != ""
                e.num_tool_timeouts += outcome == "timeout"
            busy["tool_seconds"] += time.perf_counter() - start
            return
        if e.env is None:
            e.done = True
            return
        start = time.perf_counter()
        result = await env_call(self.hooks, e.env, "step", ([dict(m) for m in e.messages],), e.where(),
                                self.env_timeout)
        busy["env_seconds"] += time.perf_counter() - start
        messages, reward = checked_step(result, f"environment {type(e.env).__name__}.step", e.where())
        e.messages += [{**m, "content": self._bounded(e, m["content"])} for m in messages]
        e.reward += reward
        if reward:  # where the turn's reward belongs (the turn's tokens end here): turn_rewards
            e.turn_rewards.append((len(e.ids) - 1, reward))
        e.done = bool(result.done)

    def _bounded(self, e: Episode, text: str) -> str:
        """A tool's or the environment's message text, cut to what the row can hold: text longer than
        (tokens the row has left) x (characters of the longest token) + 1 characters cannot fit, so
        the episode ends truncated either way, and the cut spares tokenizing the rest (a 10 MB tool
        result). What UTF-8 cannot write (a lone surrogate) becomes "?": the tokenizer refuses it."""
        room = max(self.max_model_len - len(e.ids) - self.max_tokens, 0)
        text = text[:room * self.max_token_chars + 1]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "replace").decode("utf-8")
        return text

    def extend_to_next_prompt(self, e: Episode) -> None:
        """The ids between this turn's last sampled token and the next turn's first: the rest of
        the assistant turn's closing, the new messages, the generation prompt (no labels). A
        template that re-renders earlier turns once more follow (Qwen3's strips the reasoning of
        assistant turns before the last user message) renders the new messages after a stand-in
        turn instead, as verl does: the row keeps what the model saw when it sampled, each turn
        extending it, and the trainer scores exactly that row."""
        assistant_at = max(i for i, m in enumerate(e.messages) if m["role"] == "assistant")
        before = self._render(e, e.messages[:assistant_at + 1])
        source = "the tool results" if e.messages[-1]["role"] == "tool" else f"environment {type(e.env).__name__}.step"
        after = self._render(e, e.messages, add_generation_prompt=True, after=source)
        if not after.startswith(before):
            stand_in = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
            before = self._render(e, stand_in)
            after = self._render(e, stand_in + e.messages[assistant_at + 1:], add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template is not prefix-preserving across turns: the conversation rendered "
                             f"after turn {e.num_turns} does not start with its rendering up to that turn "
                             f"({before[-80:]!r}); multi-turn rollouts need a template whose earlier turns render "
                             "the same whatever follows them, or at least new messages after an assistant turn")
        closing = self.closing[len(e.ended_with):] if self.closing.startswith(e.ended_with) else self.closing
        delta = self.tokenizer.encode(closing + after[len(before):])
        if len(e.ids) + len(delta) + self.max_tokens > self.max_model_len:
            e.truncated = True  # the next turn would run past the model's positions: the row ends here
            return
        e.ids += delta
        e.logps += [None] * len(delta)


async def gather(awaitables: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*awaitables))


def episode_stats(episodes: list[Episode], tool_seconds: float, env_seconds: float) -> dict[str, float]:
    """A rollout's multi-turn metrics (per-episode means; counts summed over the rollout)."""
    n = max(len(episodes), 1)
    return {"turns_per_episode": sum(e.num_turns for e in episodes) / n,
            "tool_calls_per_episode": sum(e.num_tool_calls for e in episodes) / n,
            "tool_use_rate": sum(e.num_tool_calls > 0 for e in episodes) / n,  # episodes with a tool call
            "tool_errors": float(sum(e.num_tool_errors for e in episodes)),
            "tool_timeouts": float(sum(e.num_tool_timeouts for e in episodes)),
            "truncated_episodes": float(sum(e.truncated for e in episodes)),
            "prefill_tokens_per_episode": sum(e.num_prefill_tokens for e in episodes) / n,
            "prompt_tokens_per_episode": sum(e.num_prompt_tokens for e in episodes) / n,
            "tool_seconds": tool_seconds, "env_seconds": env_seconds}
