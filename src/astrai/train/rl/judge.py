"""The ``judge`` reward: an LLM judge behind any OpenAI-compatible chat endpoint scores completions.

A built-in of ``rl/rewards.py`` (``rewards: [judge]``), called once per rollout in TRL's batched
form. Each completion becomes one chat request: ``judge_prompt`` with ``{prompt}`` (the record's
last user message, or the prompt text), ``{completion}`` and ``{answer}`` (the record's reference,
empty when it has none), sent to ``judge_url`` for ``judge_model`` (default: the server's first
model) with temperature 0 and, when ``judge_api_key_env`` names an environment variable, its value
as the bearer key (``bearer_header``, which ``teacher_url`` uses too; the key is never logged, and
the config names only the variable). A 401 or 403 answer is an error: no later request can succeed. Identical requests within a rollout are asked once; up to ``judge_concurrency``
are in flight at a time, each bounded by ``reward_timeout`` seconds and retried on 429 and 5xx
answers and dropped connections with exponential backoff. The score is the first number in the
judge's reply; a reply without one, or a request that still fails, scores ``None`` (no score, never
a silent 0), counted per completion in the ``judge_failures`` term (``rewards/judge_failures``).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from astrai.config import RLConfig

DEFAULT_JUDGE_PROMPT = ("Rate the answer to the question from 0 (wrong) to 10 (perfect).\n"
                        "Question: {prompt}\nReference answer: {answer}\nAnswer: {completion}\n"
                        "Reply with the number only.")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RETRIES = 3
BACKOFF_S = 0.5  # the first retry's wait; each next one doubles it


def chat_route(url: str) -> str:
    """The chat completions route under `url` (a server's base URL, or its /v1)."""
    base = url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


def bearer_header(field: str, env_name: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}`` with KEY the value of environment variable `env_name`
    (the setting `field` names it), ``{}`` without one; an unset variable is an error."""
    if not env_name:
        return {}
    key = os.environ.get(env_name)
    if not key:
        raise ValueError(f"{field}={env_name!r} names an environment variable that is not set; export it with "
                         f"the server's API key, or unset {field}")
    return {"Authorization": f"Bearer {key}"}


def auth_refused(url: str, code: int, field: str) -> ValueError:
    """The error for a server that refuses the key (401/403): asking again cannot help."""
    return ValueError(f"{url} answered {code} ({'unauthorized' if code == 401 else 'forbidden'}); set {field} to the "
                      "environment variable holding its API key (astrai serve: the --api_key value), or fix that key")


def parse_score(text: str) -> float | None:
    """The first number in a judge's reply, None when it holds none (or one that is not finite)."""
    found = NUMBER.search(text or "")
    if found is None:
        return None
    value = float(found.group())
    return value if math.isfinite(value) else None


class Judge:
    """A TRL-style batched reward: ``judge(prompts=..., completions=..., **columns)`` -> one score
    or None per completion. ``num_requests`` counts the requests sent (deduplicated)."""

    none_term = "judge_failures"  # RewardSet's term for the completions without a score

    def __init__(self, cfg: RLConfig):
        if not cfg.judge_url:
            raise ValueError("the judge reward needs judge_url (an OpenAI-compatible server, e.g. "
                             "http://127.0.0.1:8000); set --judge_url or remove judge from rewards")
        self.route, self.model = chat_route(cfg.judge_url), cfg.judge_model
        self.template, self.timeout = cfg.judge_prompt or DEFAULT_JUDGE_PROMPT, float(cfg.reward_timeout)
        self.concurrency = cfg.judge_concurrency
        try:
            self.template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"judge_prompt {self.template[:80]!r} is not a template of {{prompt}}, {{completion}} "
                             f"and {{answer}} ({type(e).__name__}: {e}); write other braces as {{{{ and }}}}") from None
        self.headers = {"Content-Type": "application/json", **bearer_header("judge_api_key_env", cfg.judge_api_key_env)}
        self.num_requests = 0
        self.__name__ = "judge"

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        answers = columns.get("answer") or [None] * len(completions)
        texts = [self.render(p, c, a) for p, c, a in zip(prompts, completions, answers)]
        unique = list(dict.fromkeys(texts))  # identical requests are asked once
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(unique)))) as pool:
            scores = dict(zip(unique, pool.map(self.ask, unique)))
        self.num_requests += len(unique)
        return [scores[t] for t in texts]

    def render(self, prompt: Any, completion: Any, answer: Any) -> str:
        """The judge's request text for one completion (chat prompts and completions as TRL passes
        them: message lists, whose last user / assistant content is used)."""
        if isinstance(prompt, list):
            users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
            prompt = users[-1] if users else ""
        if isinstance(completion, list):
            completion = completion[-1].get("content", "") if completion else ""
        return self.template.format(prompt=prompt, completion=completion, answer="" if answer is None else answer)

    def ask(self, text: str) -> float | None:
        """One request, retried; its score, or None when it fails or the reply holds no number."""
        reply = self._post({"messages": [{"role": "user", "content": text}], "temperature": 0.0})
        if reply is None:
            return None
        try:
            return parse_score(reply["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            return None

    def _post(self, body: dict[str, Any]) -> dict[str, Any] | None:
        if self.model is None:
            self.model = self._served_model() or "judge"
        data = json.dumps({"model": self.model, **body}).encode()
        for attempt in range(RETRIES + 1):
            request = urllib.request.Request(self.route, data=data, headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout or None) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):
                    raise auth_refused(self.route, e.code, "judge_api_key_env") from None
                if not (e.code == 429 or e.code >= 500):
                    return None  # the request itself is wrong: asking again gives the same answer
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError):
                pass
            if attempt < RETRIES:
                time.sleep(BACKOFF_S * 2**attempt)
        return None

    def _served_model(self) -> str | None:
        """The server's first model id (GET /v1/models), or None when it does not list one."""
        request = urllib.request.Request(self.route.removesuffix("/chat/completions") + "/models", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout or None) as response:
                return json.loads(response.read())["data"][0]["id"]
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise auth_refused(request.full_url, e.code, "judge_api_key_env") from None
            return None
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError, KeyError, IndexError):
            return None
