"""Tool definitions and a scripted model for the tool-calling tests of both APIs: WEATHER and TIME
(JSON schemas), a request that asks for the weather, the text of a call, a sampler that "says" a
fixed token sequence whatever the logits, and a live app whose model answers with that call."""

from __future__ import annotations

import contextlib
import json

import torch

from astrai.data.tokenizer import load_tokenizer
from astrai.infer.sampling import SamplerOutput
from astrai.serve.app import ServeConfig, load_engine
from tests.serve.conftest import API_KEY
from tests.serve.live import LiveApp

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in paris?"}]
CALL_TEXT = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'


class ScriptedSampler:
    """Every sequence emits `script` token by token, whatever the logits."""

    def __init__(self, script: list[int]):
        self.script = script

    def sample(self, logits: torch.Tensor, rows: list) -> SamplerOutput:
        tokens = [self.script[min(len(r.output_token_ids), len(self.script) - 1)] for r in rows]
        zeros = torch.zeros(len(rows))
        return SamplerOutput(token_ids=tokens, logprobs=zeros, raw_logprobs=zeros)


@contextlib.contextmanager
def scripted_app(model_dir):
    """A live app whose model answers with CALL_TEXT (then end of turn)."""
    tok = load_tokenizer(model_dir)
    script = tok.encode(CALL_TEXT) + [tok.convert_tokens_to_ids(["<|im_end|>"])[0]]

    def loader(config):
        engine, tokenizer = load_engine(config)
        engine.sampler = ScriptedSampler(script)
        return engine, tokenizer

    config = ServeConfig(str(model_dir), served_model_name="tiny-model", api_key=API_KEY,
                         engine_kwargs={"max_model_len": 1024, "kv_cache_tokens": 8192})
    with LiveApp(config, loader) as live:
        live.wait_status("ready")
        yield live


def check_weather_args(arguments: str) -> None:
    """Arguments of a `get_weather` call that match WEATHER's schema."""
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    assert args["unit"] in ("celsius", "fahrenheit")
