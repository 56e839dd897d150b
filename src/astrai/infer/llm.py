"""`LLM`: offline generation with vLLM's names, `LLM(model_dir | model, tokenizer).generate(...)`.

A thin convenience layer over `LLMEngine` (engine.py) that uses only the engine's public API: it
builds the engine from a model directory or a live module, turns a single prompt or a list of
conversations into prompts (`chat` applies the tokenizer's chat template), and runs them with
`LLMEngine.generate_all` on the caller's thread, optionally behind a tqdm progress bar. Used by
`astrai generate`, `astrai eval` and the demo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from astrai.infer.engine import LLMEngine
from astrai.infer.outputs import RequestOutput
from astrai.infer.sampling import SamplingParams


class LLM:
    """Offline generation with vLLM's names: `LLM(model_dir | model, tokenizer).generate(...)`."""

    def __init__(self, model: str | Path | nn.Module, tokenizer: Any | None = None, **config_fields: Any) -> None:
        # offline generation is judged by throughput, not by the gaps between one stream's tokens:
        # unless given, no per-step prefill cap (as vLLM's LLM class defaults differ from its server's)
        if config_fields.get("long_prefill_token_threshold") is None:
            config_fields["long_prefill_token_threshold"] = 0
        if isinstance(model, str | Path):
            self.engine = LLMEngine.from_pretrained(model, **config_fields)
            if tokenizer is not None:
                self.engine.tokenizer = tokenizer
        else:
            self.engine = LLMEngine(model, tokenizer, **config_fields)

    def get_tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation (a list of {role, content})."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations]
        return self._run(prompts, params, use_tqdm)

    def _run(self, prompts: list, params: SamplingParams | list[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        if not use_tqdm:
            return self.engine.generate_all(prompts, params)
        from tqdm import tqdm

        with tqdm(total=len(prompts), desc="generating", unit="prompt") as bar:
            return self.engine.generate_all(prompts, params, on_finish=lambda: bar.update(1))
