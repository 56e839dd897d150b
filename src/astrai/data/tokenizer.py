"""Tokenizer: Hugging Face `tokenizers` wrapper and chat templates.

This is the first stage of the data flow: text and chat records become token ids here, and
everything downstream (preprocess, datasets, the inference engine, the server) only sees ids.
A tokenizer lives in a model directory as `tokenizer.json` + `tokenizer_config.json` (with the
`chat_template`), so the same directory loads in transformers' `AutoTokenizer`. Chats are
rendered with a sandboxed jinja2 environment that mirrors transformers' `apply_chat_template`,
and `encode_chat` derives the assistant loss mask from the template itself by rendering the
conversation incrementally and checking that every rendering is a prefix of the next. Training
a new tokenizer (byte-level BPE with these special tokens and the ChatML template) and its CLI
live in tokenizer_training.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# ChatML with system / user / assistant / tool roles, OpenAI-style tool calls and tool lists.
# Newlines only appear inside string literals so the template renders the same under any
# whitespace settings.
CHATML_TEMPLATE = (
    "{%- macro content_text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- content_text(messages[0].content) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, reply with <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>.<|im_end|>\\n' -}}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + content_text(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{%- if not loop.first -%}{{- raise_exception('a system message is only allowed first') -}}{%- endif -%}"
    "{%- elif message.role == 'user' or message.role == 'tool' -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + content_text(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + content_text(message.content) -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
    "{%- if not loop.first or message.content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>{\"name\": \"' + call.name + '\", \"arguments\": ' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}"
    "{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('unknown role ' + message.role + '; expected system, user, assistant or tool') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # transformers overrides jinja's tojson (which escapes HTML); match it so renders agree.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile `template` in the same sandbox and with the same globals as transformers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of a model directory."""

    def __init__(self, backend: BackendTokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | None = None, extra_stop_token_ids: Iterable[int] = ()):
        self.backend = backend
        self.config = dict(config or {})
        for key in _SPECIAL_KEYS:
            setattr(self, key, _token_content(self.config.get(key)))
        if chat_template is None:
            chat_template = self.config.get("chat_template")
        self.chat_template = chat_template
        self._extra_stop_token_ids = list(extra_stop_token_ids)

    def __getstate__(self) -> dict[str, Any]:
        # picklable (a spawned rollout process gets one): the compiled template holds lambdas and
        # is compiled again on first use
        return {k: v for k, v in self.__dict__.items() if k != "_compiled_template"}

    # ---- ids of special tokens -------------------------------------------------------------
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @cached_property
    def stop_token_ids(self) -> list[int]:
        """eos plus the token that closes an assistant turn in the chat template (e.g. <|im_end|>)."""
        ids = [self.eos_token_id] + self._end_of_turn_ids() + self._extra_stop_token_ids
        return list(dict.fromkeys(i for i in ids if i is not None))

    def _end_of_turn_ids(self) -> list[int]:
        # Render an assistant turn and read which special token the template puts after it, so
        # stop tokens follow the template rather than a list of known model families.
        if not self.chat_template:
            return []
        sentinel = "\x00sentinel\x00"
        try:
            text = self.apply_chat_template([{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": sentinel}], tokenize=False)
        except jinja2.exceptions.TemplateError:
            return []
        tail = text.split(sentinel, 1)[-1]
        special = set(self.backend.get_added_tokens_decoder())
        return [i for i in self.encode(tail)[:1] if i in special]

    # ---- plain text ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int | None]:
        return [self.backend.token_to_id(t) for t in tokens]

    # ---- chat ------------------------------------------------------------------------------
    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; add one to tokenizer_config.json "
                             "or train a tokenizer with `astrai tokenizer train`, which writes ChatML")
        return compile_chat_template(self.chat_template)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Render `messages` to text exactly as transformers' apply_chat_template(tokenize=False)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got {messages!r:.200}")
        # Like transformers: keys whose value is None are dropped, special tokens are variables.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {key: getattr(self, key) for key in _SPECIAL_KEYS if getattr(self, key) is not None}
        variables.update(kwargs)
        return self._compiled_template.render(messages=messages, tools=tools, documents=None,
                                              add_generation_prompt=add_generation_prompt, **variables)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict] | None = None,
                            **kwargs: Any) -> list[int] | str:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text) if tokenize else text

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """Token ids and a loss mask that is 1 on assistant content and its end-of-turn token.

        The spans come from the template: for each assistant message i, the rendering of
        messages[:i] with the generation prompt must be a prefix of the rendering of
        messages[:i+1], and the difference (minus trailing whitespace) is what the model must
        learn to generate. Each segment is encoded on its own, so the prompt ids equal those the
        inference engine sees when it is given messages[:i] with add_generation_prompt=True.
        """
        full = self.render_chat(messages, tools=tools)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render_chat(messages[:i], add_generation_prompt=True, tools=tools)
            upto = full if i + 1 == len(messages) else self.render_chat(messages[: i + 1], tools=tools)
            if not upto.startswith(prompt) or not full.startswith(upto):
                raise ValueError(
                    f"chat template is not prefix-preserving at message {i}: rendering messages[:{i}] "
                    f"with the generation prompt gives {prompt[-80:]!r} which is not a prefix of "
                    f"rendering messages[:{i + 1}] ({upto[-80:]!r}) or of the whole chat; loss masks "
                    "need a template whose earlier turns render the same whatever follows them")
            start, end = len(prompt), len(upto.rstrip())
            if spans and start < spans[-1][1]:
                raise ValueError(f"chat template renders assistant message {i} overlapping the previous one")
            if end > start:
                spans.append((start, end))
        ids: list[int] = []
        mask: list[int] = []
        cursor = 0
        for start, end in spans:
            for text, flag in ((full[cursor:start], 0), (full[start:end], 1)):
                if text:
                    piece = self.encode(text)
                    ids += piece
                    mask += [flag] * len(piece)
            cursor = end
        if cursor < len(full):
            piece = self.encode(full[cursor:])
            ids += piece
            mask += [0] * len(piece)
        if not any(mask):
            raise ValueError("chat has no assistant tokens to train on (no assistant message with content); "
                             "add an assistant reply or use train_type 'prompt' for prompts without answers")
        if all(mask):
            raise ValueError("chat renders as assistant tokens only, so there is no prompt to condition on; "
                             "add a user message before the assistant reply")
        return ids, mask

    # ---- files -----------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (loadable by transformers' AutoTokenizer)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        config = dict(self.config)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for key in _SPECIAL_KEYS:
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load tokenizer.json + tokenizer_config.json (+ chat_template.jinja) from a model directory."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"tokenizer directory '{path}' has no tokenizer.json; point it at a model directory or "
            "train one with `astrai tokenizer train --input FILE --vocab_size N --out DIR`")
    try:
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - `tokenizers` raises a bare Exception for bad files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path / 'tokenizer.json'} is damaged and cannot be read ({reason}); restore the "
                         "file or point to another model directory") from None
    config_path = path / "tokenizer_config.json"
    config = _read_json_object(config_path) if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if (path / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it on its own
        template = (path / "chat_template.jinja").read_text()
    extra_stops: list[int] = []
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = _read_json_object(gen_path).get("eos_token_id")
        extra_stops = [eos] if isinstance(eos, int) else list(eos or [])
    return Tokenizer(backend, config, chat_template=template, extra_stop_token_ids=extra_stops)


def _read_json_object(file: Path) -> dict[str, Any]:
    """A JSON object file beside tokenizer.json; a damaged one is a ValueError naming it."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is damaged: not valid JSON ({exc}); restore the file or point to another "
                         "model directory") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} is damaged: expected a JSON object, got {type(value).__name__}")
    return value


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
