"""A reward model as a reward: a scalar-head model directory that scores prompt + completion.

``RewardSet`` (``rewards.py``) builds one for a ``rewards`` entry that is a model directory
(transformers' sequence-classification ``score.weight``, or ``value_head.weight``/``.bias``; a
``train_type: reward`` checkpoint is one). It reads the policy's token ids when it shares the
policy's tokenizer (``data/tokenizer.same_tokenizer``) and re-encodes the texts with its own
otherwise; a finished turn gets the chat template's ``turn_suffix``, so the score is read where a
reward model trained on rendered conversations learned it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from astrai.data.tokenizer import load_tokenizer, same_tokenizer


def turn_suffix(tokenizer: Any) -> list[int]:
    """The ids a chat template puts after the stop token that closes an assistant turn (ChatML: the
    newline after ``<|im_end|>``), [] when it puts none or has no template. A reward model trained
    on rendered conversations (``train_type: reward``) read its score there, at the row's last
    token, so a finished rollout is scored with them appended: at the position the model learned."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return []
    full = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    stops = set(tokenizer.stop_token_ids)
    ends = [i for i, t in enumerate(full) if t in stops]
    return list(full[ends[-1] + 1:]) if ends else []


class RewardModel:
    """A scalar-head model that scores prompt + completion token ids (the value at the last token).

    ``tokenizer`` is the reward model's own when its directory has one that differs from the
    policy's (``same_tokenizer``); then ``inputs`` re-encodes the texts, else it passes the
    policy's ids through, a finished turn (ending in a stop token) followed by the chat template's
    ``turn_suffix``: the row a rendered conversation gives, as the reward model was trained on."""

    def __init__(self, path: str | Path, device: torch.device, batch_size: int = 16,
                 policy_tokenizer: Any | None = None):
        from astrai.model.value import ValueModel

        self.path = str(path)
        self.model = ValueModel.from_pretrained(path, device, require_head=True)
        self.model.eval().requires_grad_(False)
        self.device, self.batch_size = device, batch_size
        self.tokenizer = None
        if policy_tokenizer is not None and (Path(path) / "tokenizer.json").is_file():
            own = load_tokenizer(path)
            self.tokenizer = None if same_tokenizer(own, policy_tokenizer) else own
        self.suffix = turn_suffix(policy_tokenizer) if self.tokenizer is None else []
        self.stops = set(policy_tokenizer.stop_token_ids) if self.suffix else set()

    def inputs(self, prompts: list[str], completions: list[str], records: list[dict[str, Any]],
               sequences: list[list[int]]) -> list[list[int]]:
        """The token ids to score: the policy's (``sequences``) with a shared tokenizer, else the
        prompt's messages + the completion as an assistant turn through this model's chat template,
        or, without a template, the decoded prompt text + completion, encoded by its tokenizer."""
        tok = self.tokenizer
        if tok is None:
            return [s + self.suffix if s and s[-1] in self.stops else s for s in sequences]
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
