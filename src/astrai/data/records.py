"""Input records -> token arrays: the one place that reads JSONL record forms.

Both `astrai preprocess` (records -> shards) and the datasets that read small JSONL files on
the fly call `encode_record`, so a shard and its JSONL source give identical samples. A record
that cannot be used raises `RecordError` whose message names the field, what was found and the
fix; callers skip and count such records (or stop, with --strict).

Record kinds and their forms: `{"text"}` (seq); `{"messages"}` or `{"instruction", "input",
"output"}` (sft); `{"prompt" or "messages", "chosen", "rejected"}` with strings or message lists
(dpo, with an optional numeric "margin"); `{"messages" or "prompt" or "instruction"/"input", "answer"?,
"metadata"?}` (prompt);
`{"prompt" or "messages", "responses", "rewards", "logprobs"?}` (rollout: scored samples).
The data layer knows record kinds only; which kind a train type reads is the objective's choice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from astrai.data.tokenizer import Tokenizer

RECORD_KINDS = ("seq", "sft", "dpo", "prompt", "rollout")
# the fields each record kind reads (what `data_columns` may map a dataset's columns onto)
RECORD_FIELDS = {
    "seq": ("text",),
    "sft": ("messages", "instruction", "input", "output", "tools"),
    "dpo": ("prompt", "messages", "chosen", "rejected", "tools", "margin"),
    "prompt": ("messages", "prompt", "instruction", "input", "output", "answer", "metadata", "tools"),
    "rollout": ("prompt", "messages", "responses", "rewards", "logprobs"),
}
TRUNCATION_MODES = ("keep_start", "keep_end", "error")
_PROMPT_KEYS = {"messages", "prompt", "instruction", "input", "answer", "metadata", "output"}


class RecordError(ValueError):
    """A record that cannot be used; the message says which field is wrong and how to fix it."""


# what a record of each kind holds, in words (errors that name the kind a file's records are)
KIND_SHAPES = {"seq": "'text'", "sft": "'messages' ending with the assistant's reply",
               "dpo": "'prompt', 'chosen', 'rejected'", "prompt": "'messages' to answer, with an 'answer'",
               "rollout": "'responses' with their 'rewards'"}


class RecordKindError(ValueError):
    """The records read for one kind all have the fields of another (`found`): a run given the
    wrong data, or the wrong train type for its data."""

    def __init__(self, found: str, expected: str, names: str, count: int):
        self.found, self.expected = found, expected
        super().__init__(f"the first {count} records of {names} are {found} records ({KIND_SHAPES[found]}), not "
                         f"{expected} records ({KIND_SHAPES[expected]})")


def record_form(record: Any) -> str | None:
    """The record kind a record's fields look like, None when they fit none (for naming what a
    file holds when its records fail as another kind)."""
    if not isinstance(record, dict):
        return None
    if "responses" in record:
        return "rollout"
    if "chosen" in record and "rejected" in record:
        return "dpo"
    if "text" in record:
        return "seq"
    messages = record.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        return "sft" if messages[-1].get("role") == "assistant" else "prompt"
    return None


def iter_jsonl(paths: Iterable[str | Path]) -> Iterator[tuple[str, Any]]:
    """Yield ("file:line", record) per non-empty line; a line that is not JSON yields a RecordError."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"input file '{path}' does not exist")
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{path.name}:{lineno}"
                try:
                    # a UTF-8 byte-order mark at the start of a file (as some editors write) is not data
                    yield where, json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
                except UnicodeDecodeError as e:
                    yield where, RecordError(f"line is not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8")
                except json.JSONDecodeError as e:
                    yield where, RecordError(f"invalid JSON ({e.msg} at column {e.colno})")


def _type_name(value: Any) -> str:
    return type(value).__name__


def _messages(value: Any, field: str, default_role: str | None) -> list[dict[str, Any]]:
    # A string becomes one message of `default_role` (when given); a list must hold role dicts.
    if isinstance(value, str) and default_role is not None:
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list) or not value:
        expected = "a string or a non-empty list of messages" if default_role else "a non-empty list of messages"
        raise RecordError(f"field '{field}' must be {expected}, got {_type_name(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RecordError(f"field '{field}[{i}]' must be a dict with a string 'role', got {m!r:.80}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RecordError(f"field '{field}[{i}].content' must be a string or a list of parts, "
                              f"got {_type_name(content)}")
    return value


def instruction_messages(record: dict[str, Any], with_output: bool = True) -> list[dict[str, Any]]:
    """instruction -> system, input -> user, output -> assistant, skipping empty fields."""
    messages = []
    for field, role in (("instruction", "system"), ("input", "user"), ("output", "assistant")):
        value = record.get(field)
        if field == "output" and not with_output:
            break
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise RecordError(f"field '{field}' must be a string, got {_type_name(value)}")
        messages.append({"role": role, "content": value})
    return messages


def _chat_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in record:
        return _messages(record["messages"], "messages", None)
    if "instruction" in record or "output" in record:
        return instruction_messages(record)
    raise RecordError(f"sft record needs 'messages' or 'instruction'/'input'/'output'; found keys {sorted(record)}")


def _prompt_messages(record: dict[str, Any], form: str) -> list[dict[str, Any]]:
    if "messages" in record:
        return _messages(record["messages"], "messages", None)
    if "prompt" in record:
        return _messages(record["prompt"], "prompt", "user")
    if "instruction" in record or "input" in record:
        messages = instruction_messages(record, with_output=False)
        if messages:
            return messages
    raise RecordError(f"{form} record needs 'messages', 'prompt' or 'instruction'/'input'; "
                      f"found keys {sorted(record)}")


def _truncate(ids: list[int], mask: list[int], max_seq_len: int, mode: str) -> tuple[list[int], list[int]]:
    if len(ids) <= max_seq_len:
        return ids, mask
    if mode == "error":
        raise RecordError(f"record has {len(ids)} tokens but max_seq_len is {max_seq_len}; raise --max_seq_len "
                          "or use --truncation keep_start|keep_end")
    num_tokens = len(ids)  # before the cut: the record's own length
    cut = slice(0, max_seq_len) if mode == "keep_start" else slice(num_tokens - max_seq_len, None)
    ids, mask = ids[cut], mask[cut]
    if not any(mask):
        raise RecordError(f"record has {num_tokens} tokens, over max_seq_len {max_seq_len}, and no assistant "
                          f"token remains after truncation ({mode}); raise --max_seq_len or change --truncation")
    return ids, mask


def _encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: Any = None):
    try:
        return tokenizer.encode_chat(messages, tools=tools)
    except RecordError:
        raise
    except (ValueError, TypeError) as e:
        raise RecordError(str(e)) from e
    except Exception as e:  # jinja2 TemplateError and friends: the template rejected the record
        raise RecordError(f"chat template failed: {e}") from e


def record_text(record: Any) -> str:
    """The text of a seq record."""
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {_type_name(record)}")
    text = record.get("text")
    if not isinstance(text, str):
        found = "no 'text' field" if "text" not in record else f"{_type_name(text)}"
        raise RecordError(f"seq record needs a string field 'text', got {found}; keys are {sorted(record)}")
    if not text:
        raise RecordError("field 'text' is empty")
    return text


def finish_text(tokenizer: Tokenizer, ids: list[int]) -> dict[str, list[int]]:
    """A seq document's ids with eos appended: eos separates documents in the token stream."""
    if not ids:
        raise RecordError("field 'text' encodes to no tokens")
    eos = tokenizer.eos_token_id
    if eos is not None and ids[-1] != eos:
        ids = ids + [eos]
    return {"input_ids": ids}


def encode_record(record: Any, kind: str, tokenizer: Tokenizer, max_seq_len: int,
                  truncation: str = "keep_start") -> dict[str, list[int]]:
    """Token arrays for one record; keys depend on the record kind (see module docstring)."""
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {_type_name(record)}")
    if kind == "seq":
        return finish_text(tokenizer, tokenizer.encode(record_text(record), add_special_tokens=True))
    if kind == "sft":
        ids, mask = _encode_chat(tokenizer, _chat_messages(record), record.get("tools"))
        ids, mask = _truncate(ids, mask, max_seq_len, truncation)
        return {"input_ids": ids, "loss_mask": mask}
    if kind == "dpo":
        return _encode_dpo(record, tokenizer, max_seq_len, truncation)
    if kind == "prompt":
        return _encode_prompt(record, tokenizer, max_seq_len)
    if kind == "rollout":
        return _encode_rollout(record, tokenizer, max_seq_len)
    raise ValueError(f"unknown record kind '{kind}'; expected one of {', '.join(RECORD_KINDS)}")


def _encode_rollout(record: dict[str, Any], tokenizer: Tokenizer, max_seq_len: int) -> dict[str, list[int]]:
    """A prompt with scored responses: prompt ids, every response's ids (concatenated) and, as
    JSON, their lengths, rewards and optional behaviour log-probs (one per response token)."""
    prompt = _prompt_messages(record, "rollout")
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    responses, rewards = record.get("responses"), record.get("rewards")
    if not isinstance(responses, list) or not responses:
        raise RecordError(f"rollout record needs 'responses', a non-empty list of strings; found {responses!r:.80}")
    if not isinstance(rewards, list) or len(rewards) != len(responses) or not all(
            isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) for r in rewards):
        raise RecordError(f"field 'rewards' must list one finite number per response ({len(responses)}), "
                          f"got {rewards!r:.80}")
    logprobs = record.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, list) or len(logprobs) != len(responses)):
        raise RecordError(f"field 'logprobs' must hold one list per response ({len(responses)}) or be absent")
    ids_all: list[int] = []
    lengths = []
    for i, response in enumerate(responses):
        ids, _ = _encode_chat(tokenizer, prompt + _messages(response, f"responses[{i}]", "assistant"))
        if ids[:len(prompt_ids)] != prompt_ids:
            raise RecordError(f"'responses[{i}]' does not render as a continuation of the prompt; "
                              "the chat template must be prefix-preserving")
        reply = ids[len(prompt_ids):]
        if len(prompt_ids) + len(reply) > max_seq_len:
            raise RecordError(f"prompt + responses[{i}] has {len(prompt_ids) + len(reply)} tokens but max_seq_len "
                              f"is {max_seq_len}; raise --max_seq_len")
        if logprobs is not None and len(logprobs[i]) != len(reply):
            raise RecordError(f"'logprobs[{i}]' has {len(logprobs[i])} entries but responses[{i}] has {len(reply)} "
                              "tokens under this tokenizer and chat template; give one log-prob per token or none")
        ids_all += reply
        lengths.append(len(reply))
    side = {"lengths": lengths, "rewards": [float(r) for r in rewards], "logprobs": logprobs}
    return {"prompt_ids": prompt_ids, "response_ids": ids_all,
            "record_json": list(json.dumps(side).encode())}


def _encode_dpo(record: dict[str, Any], tokenizer: Tokenizer, max_seq_len: int,
                truncation: str) -> dict[str, list[int]]:
    prompt = _prompt_messages(record, "dpo")
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    out: dict[str, list[int]] = {}
    for side in ("chosen", "rejected"):
        if side not in record:
            raise RecordError(f"dpo record needs '{side}' (a string or a list of assistant messages); "
                              f"found keys {sorted(record)}")
        reply = _messages(record[side], side, "assistant")
        ids, mask = _encode_chat(tokenizer, prompt + reply, record.get("tools"))
        if ids[: len(prompt_ids)] != prompt_ids:
            raise RecordError(f"'{side}' does not render as a continuation of the prompt; "
                              "the chat template must be prefix-preserving")
        # Only the reply is compared in DPO, never assistant turns inside the prompt history.
        mask = [0] * len(prompt_ids) + mask[len(prompt_ids):]
        if not any(mask):
            raise RecordError(f"field '{side}' has no assistant tokens to train on")
        out[f"{side}_input_ids"], out[f"{side}_loss_mask"] = _truncate(ids, mask, max_seq_len, truncation)
    # how much better chosen is (train_type reward: the Bradley-Terry margin); 0 when absent
    margin = record.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
        raise RecordError(f"field 'margin' must be a finite number (how much chosen beats rejected), got {margin!r:.80}")
    out["record_json"] = list(json.dumps({"margin": float(margin)}).encode())
    return out


def _encode_prompt(record: dict[str, Any], tokenizer: Tokenizer, max_seq_len: int) -> dict[str, list[int]]:
    messages = _prompt_messages(record, "prompt")
    try:
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=record.get("tools"))
    except (ValueError, TypeError) as e:
        raise RecordError(str(e)) from e
    except Exception as e:
        raise RecordError(f"chat template failed: {e}") from e
    if len(prompt_ids) > max_seq_len:
        raise RecordError(f"prompt has {len(prompt_ids)} tokens but max_seq_len is {max_seq_len}; "
                          "shorten it or raise --max_seq_len")
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise RecordError(f"field 'metadata' must be an object, got {_type_name(metadata)}")
    metadata = {**{k: v for k, v in record.items() if k not in _PROMPT_KEYS}, **metadata}
    answer = record.get("answer", record.get("output"))  # instruction records: output is the reference
    side = {"messages": messages, "answer": answer, "metadata": metadata}
    return {"prompt_ids": prompt_ids, "record_json": list(json.dumps(side, ensure_ascii=False).encode())}

