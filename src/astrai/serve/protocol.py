"""OpenAI request schemas (pydantic) for the HTTP server.

The server (`serve/app.py`, through `serve/requests.py`) validates every JSON body against the
request models here; `requests.py` turns a valid request into `SamplingParams` (a field named as
SamplingParams' is read as that field); what the server writes back is `responses.py`'s. Unknown
fields are accepted, as OpenAI does, but named by `ignored_fields` so the app counts and logs them;
a field of the wrong type or out of range is a `ValidationError` that the app turns into a 400
naming the parameter. Types are strict (no "0.5" -> 0.5 coercion), except that an integer is
accepted where a float is expected, as JSON has one number type. The bounds of the sampling fields
are SamplingParams' own (`sampling_field` reads its knob ranges), narrowed only where the API
itself says less (OpenAI's temperature cap of 2, `n` at most 128).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from astrai.flags import field_range
from astrai.infer.sampling import SamplingParams

# A stop list is scanned on every step of its request, on the engine thread every request shares:
# these caps keep that work small (OpenAI itself allows 4 stops).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_FIELD_NAME_CHARS = 100  # an ignored field's name as logged (see ignored_fields)


class StrictModel(BaseModel):
    """The base of every request object (here and in anthropic.py): strict types, no coercion."""

    # unknown fields are kept (not used) so the app can count and log them: see ignored_fields
    model_config = ConfigDict(extra="allow", strict=True)


def sampling_field(name: str, default: Any = None, **narrower: float) -> Any:
    """A request field bounded as SamplingParams' field `name` (its knob range), so a request is
    refused (400, naming the parameter) exactly where SamplingParams would refuse the value;
    `narrower` adds the API's own tighter bounds (OpenAI caps temperature at 2)."""
    return Field(default, **{**field_range(SamplingParams, name).bounds(), **narrower})


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields of a validated request (and its nested objects) astrai ignores.
    A name the client chose is shown escaped as by `repr`, cut to MAX_FIELD_NAME_CHARS: a newline
    in it cannot forge a log line, nor a megabyte-long name make a megabyte-long one."""
    out = [prefix + shown_name(name) for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                out += ignored_fields(item, f"{prefix}{name}.")
    return out


def shown_name(name: str) -> str:
    """A client-chosen name as logs show it: its repr without the quotes (a newline is `\\n`), at
    most MAX_FIELD_NAME_CHARS long."""
    text = repr(name)[1:-1]
    return text if len(text) <= MAX_FIELD_NAME_CHARS else text[:MAX_FIELD_NAME_CHARS - 3] + "..."


def check_stops(stops: list[str]) -> None:
    """The bounds on a stop list (OpenAI's `stop`, Anthropic's `stop_sequences`); ValueError beyond."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}")


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content if content is not None else ""}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


class SamplingKnobs(StrictModel):
    """The sampling fields every generation route takes under vLLM's names (the completion
    endpoints below and the token-in route, ``serve/generate.py``), bounded as ``SamplingParams``."""

    n: int = sampling_field("n", 1, le=128)
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    top_k: int | None = sampling_field("top_k")
    min_p: float | None = sampling_field("min_p")
    frequency_penalty: float | None = sampling_field("frequency_penalty")
    presence_penalty: float | None = sampling_field("presence_penalty")
    repetition_penalty: float | None = sampling_field("repetition_penalty")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: int | None = sampling_field("seed")
    ignore_eos: bool = False
    min_tokens: int = sampling_field("min_tokens", 0)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids as strings (e.g. '50256'), got {key!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stops([value] if isinstance(value, str) else value or [])
        return value

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class _SamplingFields(SamplingKnobs):
    """Fields shared by both completion endpoints (OpenAI names plus vLLM's extras)."""

    model: str
    temperature: float | None = sampling_field("temperature", le=2.0)  # OpenAI's cap
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's token-in/token-out fields: the prompt's and each choice's token ids in the response
    return_token_ids: bool = False
    # vLLM's logprobs modes: raw_logprobs (the unprocessed model at temperature 1, the default) or
    # processed_logprobs (the sampler's behaviour log-probs: after penalties, temperature and
    # truncation, the distribution each token was drawn from; what an RL trainer needs)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(StrictModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_for_json_schema(cls, value: JsonSchemaFormat | None, info: ValidationInfo):
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema is only allowed when type is 'json_schema'")
        return value


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = sampling_field("max_tokens")
    max_completion_tokens: int | None = sampling_field("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("logprobs")
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if isinstance(value, NamedToolChoice):
            names = [t.function.name for t in tools]
            if value.function.name not in names:
                raise ValueError(f"names the function '{value.function.name}' but the tools offered are "
                                 f"{names or 'none'}; add it to tools or name one of them")
        elif value == "required" and not tools:
            raise ValueError("'required' needs at least one tool in tools")
        return value

    @field_validator("response_format")
    @classmethod
    def _one_constraint(cls, value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        choice = info.data.get("tool_choice")
        if value is not None and value.type != "text" and (choice == "required"
                                                           or isinstance(choice, NamedToolChoice)):
            raise ValueError("a JSON response_format cannot be combined with tool_choice 'required' or a "
                             "named function: both constrain the output; drop one")
        if value is not None and value.type == "json_schema" and value.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with the schema")
        return value

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: 'auto' when tools are given, else 'none'."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template's `tools` variable sees them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def forced_tools(self) -> list[tuple[str, dict[str, Any] | None]] | None:
        """(name, parameters) of the functions one of which must be called (tool_choice 'required'
        or a named function), or None when the model may answer in text."""
        choice = self.effective_tool_choice()
        if choice == "required":
            return [(t.function.name, t.function.parameters) for t in self.tools or []]
        if isinstance(choice, NamedToolChoice):
            return [(t.function.name, t.function.parameters) for t in self.tools or []
                    if t.function.name == choice.function.name]
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = sampling_field("max_tokens", 16)
    logprobs: int | None = sampling_field("logprobs")
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = sampling_field("prompt_logprobs")  # vLLM's: k alternatives per prompt token
    # astrai's: one seed per prompt (several prompts in one request, each with its own streams)
    seeds: list[Annotated[int, Field(**field_range(SamplingParams, "seed").bounds())]] | None = None

    @model_validator(mode="after")
    def _one_seed_per_prompt(self) -> CompletionRequest:
        if self.seeds is not None and len(self.seeds) != len(self.prompt_list()):
            raise ValueError(f"'seeds' has {len(self.seeds)} entries for {len(self.prompt_list())} prompt(s); "
                             "give one seed per prompt, or 'seed' for all")
        return self

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if len(value) == 0 or (isinstance(value, list) and any(len(p) == 0 for p in value
                                                               if isinstance(p, str | list))):
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill-in-the-middle) is not supported; omit it")
        return value

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # one prompt given as token ids
        return list(p)


class TokenizeRequest(StrictModel):
    """`POST /tokenize` (vLLM's shape): a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (a chat)")
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(StrictModel):
    """`POST /detokenize` (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[int]
