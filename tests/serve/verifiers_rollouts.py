"""Run inside a venv that has `verifiers` (never astrai's): an environment's rollouts against a running
`astrai serve` through verifiers' training client, printed as one JSON line (`VERIFIERS_ROLLOUTS {...}`):
one record per model call, with the call's prompt messages, prompt ids, completion ids and log-probs.

    python tests/serve/verifiers_rollouts.py BASE_URL API_KEY MODEL MODEL_DIR

verifiers 0.3 (`verifiers.legacy` present): a `MultiTurnEnv` of two turns (the prompt, the reply,
FOLLOW_UP, the reply) evaluated with the client type `openai_chat_completions_token`, its training
client: a first turn is a chat completion with `logprobs` and `extra_body={"return_token_ids": true}`,
the second goes as ids the client stitched to `/v1/chat/completions/tokens`; the ids and log-probs are
read from each rollout's trajectory. verifiers 0.4 (the v1 stack only): a `SingleAgentEnv` over a taskset of the same prompts,
whose harness holds a two-turn conversation; every model call goes through verifiers' own
interception server (a local HTTP server that the env starts) to its `TrainClient`, which renders the
prompt with the model's chat template (`MODEL_DIR`) and calls `POST /inference/v1/generate`; the ids
and log-probs are read from each trace's message graph, and the task's reward scores each trace.
The test (`test_verifiers_client.py`) checks what this prints.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import types

PROMPTS = [("hello world", "hi"), ("the quick brown fox", "dog")]
SAMPLES = 2  # rollouts per prompt
MAX_TOKENS = 10
FOLLOW_UP = "and then?"  # the user's second turn


def stop_token_bias(model_dir: str) -> dict[str, int]:
    """logit_bias that ends every reply on a stop token (the model's `eos_token_id`s) once `min_tokens`
    are out, so that a reply is never cut at max_tokens: 0.3's client stitches the next turn's prompt
    ids only after a reply that ended on a stop token (a cut one goes back to chat completions). The
    reply is long all the same: 0.3 refuses one whose text is empty, and a random model's token is a
    lone byte of a multi-byte character (no text) about a third of the time."""
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    return {str(token): 100 for token in (eos if isinstance(eos, list) else [eos])}


async def legacy_rollouts(base_url: str, model: str, model_dir: str) -> list[dict]:
    import verifiers as vf
    from datasets import Dataset

    class FollowUpEnv(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": FOLLOW_UP}]

    rows = [{"question": q, "answer": a} for q, a in PROMPTS]
    env = FollowUpEnv(max_turns=2, dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows),
                      rubric=vf.Rubric(funcs=[lambda completion, answer, **kw: float(answer in str(completion))]))
    config = vf.ClientConfig(client_type="openai_chat_completions_token", api_base_url=base_url + "/v1",
                             api_key_var="ASTRAI_TEST_KEY", max_retries=0)
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "logit_bias": stop_token_bias(model_dir),
                "extra_body": {"min_tokens": MAX_TOKENS - 1}}
    out = await env.evaluate(client=config, model=model, num_examples=len(rows), rollouts_per_example=SAMPLES,
                             sampling_args=sampling, state_columns=["trajectory"], on_progress=lambda *a, **k: None)
    rollouts = []
    for rollout in out["outputs"]:
        for turn, step in enumerate(rollout.get("trajectory") or [{}]):
            tokens = step.get("tokens") or {}
            rollouts.append({"turn": turn, "messages": step.get("prompt"), "error": rollout.get("error"),
                             "prompt_ids": tokens.get("prompt_ids"), "completion_ids": tokens.get("completion_ids"),
                             "completion_logprobs": tokens.get("completion_logprobs"),
                             "reward": rollout.get("reward")})
    return rollouts


def register_plugins() -> None:
    """verifiers 0.4 loads tasksets and harnesses by id, as importable modules exporting the class in
    `__all__`; these two are defined here and registered under their ids."""
    import verifiers.v1 as vf
    from openai import AsyncOpenAI

    class PromptTask(vf.Task):
        @vf.reward
        async def says_answer(self, task, trace) -> float:
            return float(dict(PROMPTS)[task.prompt] in trace.last_reply)

    class PromptTaskset(vf.Taskset[PromptTask, vf.TasksetConfig]):
        def load(self):
            for question, _ in PROMPTS:
                yield PromptTask(vf.TaskData(prompt=question), self.config.task)

    class TwoTurnHarness(vf.Harness[vf.HarnessConfig]):
        """A chat of two turns, run in this process (a harness may, as long as every model call goes
        to the interception `endpoint` with its `secret`): the prompt, the reply, FOLLOW_UP, the reply."""

        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
            messages = [{"role": "user", "content": data.prompt}]
            async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
                for follow_up in (FOLLOW_UP, None):
                    reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                    if follow_up is not None:
                        messages.append({"role": "user", "content": follow_up})
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    for name, cls in (("astrai_prompt_taskset", PromptTaskset), ("astrai_two_turn_harness", TwoTurnHarness)):
        module = types.ModuleType(name)
        setattr(module, cls.__name__, cls)
        module.__all__ = [cls.__name__]
        sys.modules[name] = module


def call_records(trace) -> list[dict]:
    """One record per model call of a trace: the path of message nodes that ends at the call's
    reply holds the ids the model saw (every token before the reply's sampled ones) and the sampled
    ids with their log-probs."""
    records = []
    for call in trace.calls:
        path, node = [], call.node
        while node is not None:
            path.insert(0, trace.nodes[node])
            node = trace.nodes[node].parent
        reply = path[-1]
        prompt_ids = [t for n in path[:-1] for t in n.token_ids]
        prompt_ids += [t for t, sampled in zip(reply.token_ids, reply.mask) if not sampled]
        records.append({"turn": len(records), "messages": [{"role": n.message.role, "content": n.message.content} for n in path[:-1]],
                        "error": call.error.message if call.error else None, "prompt_ids": prompt_ids,
                        "completion_ids": [t for t, sampled in zip(reply.token_ids, reply.mask) if sampled],
                        "completion_logprobs": reply.logprobs, "reward": trace.reward})
    return records


async def env_rollouts(base_url: str, model: str, model_dir: str) -> list[dict]:
    import verifiers.v1 as vf

    register_plugins()
    config = vf.resolve_env_config({"taskset": {"id": "astrai_prompt_taskset"},
                                    "agent": {"harness": {"id": "astrai_two_turn_harness"},
                                              "runtime": {"type": "subprocess"}}})
    env = vf.load_environment(config)
    client = vf.TrainClientConfig(base_url=base_url + "/v1", api_key_var="ASTRAI_TEST_KEY",
                                  renderer_model_name=model_dir)
    ctx = vf.ModelContext(client=client, model=model,
                          sampling=vf.SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0))
    async with env.serving():
        slots = [slot for task in env.taskset for slot in env.slots(task, SAMPLES)]
        episodes = await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))
    records = []
    for episode in episodes:
        errors = [error.message for error in episode.errors]
        for trace in episode.traces:
            errors += [error.message for error in trace.errors]
            records += call_records(trace)
        if errors or not episode.traces:
            records.append({"error": "; ".join(errors) or "an episode without a trace"})
    return records


def main(base_url: str, api_key: str, model: str, model_dir: str) -> None:
    import verifiers

    os.environ["ASTRAI_TEST_KEY"] = api_key
    if importlib.util.find_spec("verifiers.legacy") is not None:
        client, env, rollouts = ("openai_chat_completions_token", "MultiTurnEnv",
                                 asyncio.run(legacy_rollouts(base_url, model, model_dir)))
    else:
        client, env, rollouts = "train (renderer)", "SingleAgentEnv", asyncio.run(env_rollouts(base_url, model,
                                                                                                model_dir))
    plain = lambda o: o.model_dump() if hasattr(o, "model_dump") else str(o)  # noqa: E731 - pydantic messages
    print("VERIFIERS_ROLLOUTS " + json.dumps({"version": verifiers.__version__, "client": client, "env": env,
                                              "rollouts": rollouts}, default=plain))


if __name__ == "__main__":
    main(*sys.argv[1:5])
