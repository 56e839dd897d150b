"""Run inside a venv that has `verifiers` (never astrai's): rollouts against a running `astrai serve`
through verifiers' training client, printed as one JSON line (`VERIFIERS_ROLLOUTS {...}`).

    python tests/serve/verifiers_rollouts.py BASE_URL API_KEY MODEL MODEL_DIR

verifiers 0.3 (`verifiers.legacy` present): a `SingleTurnEnv` evaluated with the client type
`openai_chat_completions_token`, its training client (chat completions with `logprobs` and
`extra_body={"return_token_ids": true}`); the ids and log-probs are read from each rollout's
trajectory. verifiers 0.4 (the v1 stack only): its `TrainClient`, which renders the prompt with the
model's own chat template (`MODEL_DIR`) and calls `POST /inference/v1/generate`, asked for the turns
of the same prompts (0.4's environments run their turns through an interception server that hands
each one to this client). The test (`test_verifiers_client.py`) checks what this prints.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys

PROMPTS = [("hello world", "hi"), ("the quick brown fox", "dog")]
SAMPLES = 2  # rollouts per prompt
MAX_TOKENS = 6


async def legacy_rollouts(base_url: str, model: str) -> list[dict]:
    import verifiers as vf
    from datasets import Dataset

    rows = [{"question": q, "answer": a} for q, a in PROMPTS]
    env = vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows),
                           rubric=vf.Rubric(funcs=[lambda completion, answer, **kw: float(answer in str(completion))]))
    config = vf.ClientConfig(client_type="openai_chat_completions_token", api_base_url=base_url + "/v1",
                             api_key_var="ASTRAI_TEST_KEY", max_retries=0)
    out = await env.evaluate(client=config, model=model, num_examples=len(rows), rollouts_per_example=SAMPLES,
                             sampling_args={"max_tokens": MAX_TOKENS, "temperature": 1.0},
                             state_columns=["trajectory"], on_progress=lambda *a, **k: None)
    rollouts = []
    for rollout in out["outputs"]:
        for step in rollout.get("trajectory") or [{}]:
            tokens = step.get("tokens") or {}
            rollouts.append({"messages": rollout.get("prompt"), "error": rollout.get("error"),
                             "prompt_ids": tokens.get("prompt_ids"), "completion_ids": tokens.get("completion_ids"),
                             "completion_logprobs": tokens.get("completion_logprobs")})
    return rollouts


async def train_client_turns(base_url: str, model: str, model_dir: str) -> list[dict]:
    from verifiers.v1 import TrainClientConfig
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.types import SamplingConfig

    client = TrainClient(TrainClientConfig(base_url=base_url + "/v1", api_key_var="ASTRAI_TEST_KEY",
                                           renderer_model_name=model_dir))
    rollouts = []
    try:
        for question, _ in PROMPTS:
            messages = [{"role": "user", "content": question}]
            for _ in range(SAMPLES):
                response = await client.get_response(ChatDialect(), {"model": model, "messages": messages},
                                                      SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0))
                tokens = response.tokens
                rollouts.append({"messages": messages, "error": None, "prompt_ids": tokens.prompt_ids,
                                 "completion_ids": tokens.completion_ids,
                                 "completion_logprobs": tokens.completion_logprobs})
    finally:
        await client.close()
    return rollouts


def main(base_url: str, api_key: str, model: str, model_dir: str) -> None:
    import verifiers

    os.environ["ASTRAI_TEST_KEY"] = api_key
    if importlib.util.find_spec("verifiers.legacy") is not None:
        client, rollouts = "openai_chat_completions_token", asyncio.run(legacy_rollouts(base_url, model))
    else:
        client, rollouts = "train (renderer)", asyncio.run(train_client_turns(base_url, model, model_dir))
    plain = lambda o: o.model_dump() if hasattr(o, "model_dump") else str(o)  # noqa: E731 - pydantic messages
    print("VERIFIERS_ROLLOUTS " + json.dumps({"version": verifiers.__version__, "client": client,
                                              "rollouts": rollouts}, default=plain))


if __name__ == "__main__":
    main(*sys.argv[1:5])
