"""Teachers of distillation: what scores the student's tokens (``online_distill``, ``kd``).

A teacher gives the log-probability of each labelled token of a batch of rows under its own
unprocessed distribution (temperature 1, no truncation), in one prefill per row: ``LocalTeacher``
runs a frozen model directory in-process (``teacher_path``; it must share the policy's tokenizer)
through the same chunked log-prob function as the policy (``logps.reference_logps``), and also
gives full-vocabulary log-probs for the JSD losses; ``RemoteTeacher`` asks any OpenAI-compatible
completions server for the echoed prompt log-probs of token-id prompts (``teacher_url``:
``astrai serve``, vLLM), the route lm-eval's loglikelihood uses, with the API key of the
environment variable that ``teacher_api_key_env`` names as a bearer header. Both return (N, T) tensors aligned
with a rollout's labels, 0 where there is no label.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from astrai.train.losses import IGNORE_INDEX
from astrai.train.objectives.logps import reference_logps
from astrai.train.objectives.packing import forward_rows
from astrai.train.rl.judge import auth_refused, bearer_header
from astrai.train.rl.sampler import RolloutSampling

if TYPE_CHECKING:
    from astrai.config import Config
    from astrai.train.rl.data import Rollout

RAW = RolloutSampling(temperature=1.0, top_p=1.0, top_k=0)  # the teacher's own distribution
RETRIES = 3  # a teacher server's 429/5xx and dropped connections, with backoff


def policy_tokenizer(cfg: Config) -> Any:
    """The policy's tokenizer (tokenizer_path, else param_path), None when neither holds one."""
    from astrai.data.tokenizer import load_tokenizer

    path = cfg.data.tokenizer_path or cfg.train.param_path
    return load_tokenizer(path) if path is not None and (Path(path) / "tokenizer.json").is_file() else None


def check_same_tokenizer(teacher_dir: str, vocab_size: int, cfg: Config) -> None:
    """A teacher scores the student's token ids, so both must read them alike: the same
    tokenizer (when the teacher's directory has one) and an embedding row for every id."""
    from astrai.data.tokenizer import load_tokenizer, same_tokenizer

    policy = policy_tokenizer(cfg)
    own = load_tokenizer(teacher_dir) if (Path(teacher_dir) / "tokenizer.json").is_file() else None
    if policy is not None and own is not None and not same_tokenizer(policy, own):
        raise ValueError(f"teacher_path {teacher_dir} has its own tokenizer ({len(own)} tokens) but the policy's "
                         f"tokenizer ({len(policy)} tokens, {cfg.data.tokenizer_path or cfg.train.param_path}) is "
                         "another vocabulary; distillation compares log-probs of the same token ids: use a teacher "
                         "trained with the policy's tokenizer")
    if policy is not None and len(policy) > vocab_size:
        raise ValueError(f"teacher_path {teacher_dir} has vocab_size {vocab_size} but the policy's tokenizer has "
                         f"{len(policy)} tokens; use a teacher with the policy's vocabulary")


class LocalTeacher:
    """A frozen model directory in this process, on the policy's device."""

    def __init__(self, path: str, device: torch.device, cfg: Config):
        from astrai.model.hf import load_model

        self.model = load_model(path, device=device).eval().requires_grad_(False)
        check_same_tokenizer(path, self.model.config.vocab_size, cfg)
        self.device = device

    def label_logps(self, rollout: Rollout) -> Tensor:
        """log pi_teacher of each label (N, T), 0 off-label."""
        return reference_logps(self.model, rollout, RAW, self.device)

    @torch.no_grad()
    def logits(self, batch: dict[str, Any], layout: str) -> Tensor:
        """The teacher's logits (M, V) at the batch's M labelled tokens, row by row, the rows in
        `layout` (``packing.forward_rows``)."""
        out, _ = forward_rows(self.model, batch, layout, head=lambda hidden, lm_head: lm_head(hidden))
        return out.head.float()


class RemoteTeacher:
    """A completions server: one request per chunk of rows, ``echo`` with ``logprobs``, so the
    server prefills each row once and returns every token's log-prob under its model."""

    def __init__(self, url: str, timeout: float = 60.0, rows_per_request: int = 16, api_key_env: str | None = None):
        """`api_key_env`: the environment variable holding the server's API key (read once, here)."""
        self.url, self.timeout, self.rows_per_request = url.rstrip("/"), timeout, rows_per_request
        self.headers = {"Content-Type": "application/json", **bearer_header("teacher_api_key_env", api_key_env)}
        self.model_name: str | None = None

    def _post(self, route: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """JSON from `route` (GET when `body` is None), retried on 429/5xx and refused connections."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(RETRIES + 1):
            request = urllib.request.Request(f"{self.url}{route}", data=data, headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout or None) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):
                    raise auth_refused(f"teacher_url {self.url}{route}", e.code, "teacher_api_key_env") from None
                if (e.code == 429 or e.code >= 500) and attempt < RETRIES:
                    time.sleep(0.5 * 2**attempt)
                    continue
                detail = e.read()[:300].decode(errors="replace")
                raise ValueError(f"teacher_url {self.url}{route} answered {e.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt < RETRIES:
                    time.sleep(0.5 * 2**attempt)
                    continue
                raise ValueError(f"teacher_url {self.url} cannot be reached ({e}); start the teacher's server "
                                 "(astrai serve --model TEACHER_DIR) or fix --teacher_url") from None
        raise AssertionError("unreachable")

    def row_logps(self, rows: list[list[int]]) -> list[list[float]]:
        """Each row's token log-probs (its first token has none: 0.0 there)."""
        if self.model_name is None:
            self.model_name = self._post("/v1/models", None)["data"][0]["id"]
        out: list[list[float]] = []
        for start in range(0, len(rows), self.rows_per_request):
            chunk = rows[start:start + self.rows_per_request]
            answer = self._post("/v1/completions", {"model": self.model_name, "prompt": chunk, "max_tokens": 1,
                                                    "temperature": 0.0, "echo": True, "logprobs": 1})
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            for row, choice in zip(chunk, choices):
                values = (choice.get("logprobs") or {}).get("token_logprobs") or []
                if len(values) < len(row):
                    raise ValueError(f"teacher_url {self.url} returned {len(values)} prompt log-probs for a row of "
                                     f"{len(row)} tokens; it must support echo with logprobs on token-id prompts")
                out.append([0.0 if v is None else float(v) for v in values[:len(row)]])
        return out

    def label_logps(self, rollout: Rollout) -> Tensor:
        """log pi_teacher of each label (N, T), 0 off-label: label t is token t + 1 of its row."""
        lengths = rollout.attention_mask.sum(dim=1).tolist()
        rows = [ids[:n].tolist() for ids, n in zip(rollout.input_ids, lengths)]
        out = torch.zeros(rollout.labels.shape)
        for i, values in enumerate(self.row_logps(rows)):
            n = len(values)
            out[i, :n - 1] = torch.tensor(values[1:])
        return torch.where(rollout.labels != IGNORE_INDEX, out, 0.0)


def build_teacher(cfg: Config, model: nn.Module) -> LocalTeacher | RemoteTeacher:
    """The configured teacher: ``teacher_path`` (in-process) or ``teacher_url`` (a server)."""
    o = cfg.objective
    if o.teacher_path is not None:
        from astrai.model.hub import resolve_model_path
        from astrai.model.manifest import resolve_model_dir  # a ckpt_dir stands for its newest checkpoint

        path = str(resolve_model_dir(resolve_model_path(o.teacher_path, "teacher_path")))
        return LocalTeacher(path, next(model.parameters()).device, cfg)
    return RemoteTeacher(o.teacher_url, timeout=cfg.rl.reward_timeout, api_key_env=o.teacher_api_key_env)
