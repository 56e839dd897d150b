"""astrai's model for lm-evaluation-harness: lm-eval tasks run in-process on the engine.

`AstraiLM` is an lm-eval `LM` (through `TemplateLM`, which gives it lm-eval's own context /
continuation tokenisation, so requests are cut into tokens exactly as the `hf` backend cuts
them). Its three request kinds go to the engine: `loglikelihood` and `loglikelihood_rolling`
through `scoring.Scorer` (the choices of a question share their context's cached KV), and
`generate_until` as batched `generate_all` calls with the task's stop strings, token limit and
greedy or seeded sampling. `astrai eval --tasks` (cli.py) builds one from a model directory; a
caller holding an engine (e.g. a training loop) passes it in. Importing this module imports
lm_eval, which is optional: `pip install -e ".[eval]"`. It also registers the model with
lm-eval as "astrai" (`lm_eval.simple_evaluate(model="astrai", model_args="pretrained=DIR")`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from astrai.eval.scoring import Scorer, encode_text, prefix_token_id, scoring_engine
from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until tasks that set none


@register_model("astrai")
class AstraiLM(TemplateLM):
    """lm-eval's LM interface on an astrai `LLMEngine` (built from `pretrained` when not given)."""

    def __init__(self, pretrained: str | None = None, engine: LLMEngine | None = None, batch_size: int | str = 64,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int | None = None, max_batch_size: int | None = None,
                 **engine_fields: Any) -> None:
        super().__init__()  # max_batch_size: lm-eval's, for batch_size="auto"; the engine sizes its own batches
        if engine is None:
            if pretrained is None:
                raise ValueError("AstraiLM needs pretrained=DIR (a model directory) or engine=LLMEngine")
            engine = scoring_engine(str(pretrained), **engine_fields)
        if engine.tokenizer is None:
            raise ValueError("lm-eval tasks need the model's tokenizer; the model directory has no tokenizer.json")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.name = str(pretrained or "live-engine")
        self.scorer = Scorer(engine, int(batch_size) if str(batch_size).isdigit() else 64)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = seed

    # -- tokens, as lm-eval's hf backend makes them ------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            return encode_text(self.tokenizer, string)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    # -- the three request kinds -------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        results = self.scorer.loglikelihood([(ctx, cont) for _, ctx, cont in requests])
        for (request_str, _, _), answer in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        strings = [req.args[0] for req in requests]
        totals = self.scorer.loglikelihood_rolling([self.tok_encode(s) for s in strings], self.prefix_token_id)
        for string, total in zip(strings, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for i, (context, gen_kwargs) in enumerate(args):
            p, until, max_ctx = self._sampling_params(gen_kwargs, eos, i)
            prompts.append(self.tok_encode(context)[-max_ctx:] or [self.prefix_token_id])
            params.append(p)
            stops.append(until)
        texts: list[str] = []
        size = self.scorer.batch_size
        for start in range(0, len(prompts), size):
            outs = self.engine.generate_all(prompts[start : start + size], params[start : start + size],
                                            with_logprobs=False)
            for out, until in zip(outs, stops[start : start + size]):
                text = self.tokenizer.decode(out.outputs[0].token_ids)
                texts.append(postprocess_generated_text(text, until, None))
        for (context, gen_kwargs), text in zip(args, texts):
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return texts

    def _sampling_params(self, gen_kwargs: dict[str, Any], eos: str, index: int) -> tuple[SamplingParams, list[str], int]:
        """A task's generation kwargs (lm-eval's names) as SamplingParams, its stop strings, and
        how many context tokens fit (the model's length minus room for the output, as HFLM)."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        max_ctx = self.max_length - max_gen_toks
        if max_ctx <= 0:
            raise ValueError(f"max_gen_toks is {max_gen_toks} but the model takes {self.max_length} tokens; "
                             f"lower the task's max_gen_toks")
        greedy = not kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) == 0.0
        seed = kwargs.get("seed", self.seed)
        params = SamplingParams(
            temperature=0.0 if greedy else float(kwargs["temperature"]),
            top_p=float(kwargs.get("top_p") or 1.0), top_k=int(kwargs.get("top_k") or 0),
            max_tokens=max_gen_toks, stop=[s for s in until if s] or None,
            seed=None if seed is None else int(seed) + index)
        return params, until, max_ctx

    # -- chat templates (--apply_chat_template) -----------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return Path(self.name).name.replace("/", "__") or "astrai"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = self.tokenizer.render_chat(chat_history, add_generation_prompt=add_generation_prompt)
        if not add_generation_prompt and chat_history:
            # continue the final (assistant) message, as transformers' continue_final_message: cut
            # what the template puts after its content (the end-of-turn token)
            last = chat_history[-1]["content"].strip()
            if last and last in text:
                text = text[: text.rindex(last) + len(last)]
        return text
