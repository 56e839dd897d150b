"""The lm-eval adapter against lm-eval's own `hf` backend on the same model directory:
per-request log-likelihoods within 1e-4, the same greedy flags, rolling windows and greedy
generations; local tasks through `simple_evaluate` give the same metrics."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from astrai.eval.scoring import rolling_windows  # noqa: E402
from tests.eval.conftest import long_text  # noqa: E402


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("max_length", [4, 64])
def test_rolling_windows_are_lm_evals(length, max_length):
    tokens = list(range(10, 10 + length))
    theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 1, max_length, 1)]
    assert list(rolling_windows(tokens, 1, max_length)) == theirs


def test_loglikelihood_matches_hf(astrai_lm, hf_lm):
    shared = "Question: " + " ".join(["7+2=9 and 4+4=8."] * 4) + " 3+5="  # > one KV block, four choices
    args = [(shared, f" {c}") for c in ("8", "9", "15", "17")]
    args += [("", "the quick brown fox"), ("Question: 1+2=\nAnswer: ", "3"),  # empty context; a trailing space
             ("the lazy dog", " jumps"), (long_text(120, 3), " the cat")]  # a context past the model's 64 tokens
    engine = astrai_lm.engine
    hits_before = engine.block_manager.num_prefix_hits
    ours = astrai_lm.loglikelihood(instances("loglikelihood", args))
    theirs = hf_lm.loglikelihood(instances("loglikelihood", args))
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert max(abs(a - b) for (a, _), (b, _) in zip(ours, theirs)) < 1e-4, (ours, theirs)
    assert all(lp < 0 for lp, _ in ours) and len({round(lp, 3) for lp, _ in ours[:4]}) == 4
    # the choices after the first found the shared context's full blocks in the prefix cache
    assert engine.block_manager.num_prefix_hits - hits_before >= 3 * 16


def test_greedy_flag_is_true_for_the_models_own_continuation(astrai_lm, hf_lm):
    from astrai.infer.sampling import SamplingParams

    context = astrai_lm.tok_encode("the quick brown")
    out = astrai_lm.engine.generate_all([context], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    greedy = out[0].outputs[0].token_ids
    other = greedy[:2] + [(greedy[2] + 1) % astrai_lm.engine.vocab_size]
    pairs = [(context, greedy), (context, other)]
    ours = astrai_lm.scorer.loglikelihood(pairs)
    theirs = hf_lm._loglikelihood_tokens([((None, None), c, t) for c, t in pairs])
    assert [g for _, g in ours] == [g for _, g in theirs] == [True, False]
    assert max(abs(a - b) for (a, _), (b, _) in zip(ours, theirs)) < 1e-4


def test_loglikelihood_rolling_matches_hf(astrai_lm, hf_lm):
    texts = [long_text(5, 4), long_text(40, 5), long_text(200, 6)]  # one window .. several (64 tokens each)
    ours = astrai_lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    theirs = hf_lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    assert len(astrai_lm.tok_encode(texts[-1])) > 2 * astrai_lm.max_length
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4, (ours, theirs)


def test_generate_until_greedy_matches_hf(astrai_lm, hf_lm):
    args = [("Question: 3+4=\nAnswer:", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
            ("the quick brown", {"until": ["dog", "cat"], "max_gen_toks": 20, "temperature": 0.0}),
            ("the lazy", {"max_gen_toks": 6})]
    ours = astrai_lm.generate_until(instances("generate_until", args))
    theirs = hf_lm.generate_until(instances("generate_until", args))
    assert ours == theirs
    assert any(ours)


def test_generation_kwargs_map_onto_sampling_params(astrai_lm):
    params, until, max_ctx = astrai_lm._sampling_params(
        {"until": "\n\n", "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_gen_toks": 10},
        eos="<|endoftext|>", index=2)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.7, 0.9, 5, 10)
    assert until == ["\n\n", "<|endoftext|>"] and params.stop == until and max_ctx == astrai_lm.max_length - 10
    greedy, _, _ = astrai_lm._sampling_params({"do_sample": False, "temperature": 0.7, "max_gen_toks": 4}, eos="",
                                             index=0)
    assert greedy.greedy


def test_seeded_sampling_repeats_and_the_seed_matters(astrai_lm):
    def sample(seed: int) -> list[str]:
        astrai_lm.seed = seed
        kwargs = {"do_sample": True, "temperature": 1.0, "max_gen_toks": 12, "until": ["\n"]}
        return astrai_lm.generate_until(instances("generate_until", [("the quick", kwargs)] * 4))

    try:
        first, again, other = sample(1), sample(1), sample(2)
    finally:
        astrai_lm.seed = None
    assert first == again
    assert first != other and len(set(first)) > 1  # per-request seeds: the four samples differ too


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_hf(astrai_lm, hf_lm, add_generation_prompt):
    history = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3+4="}]
    if not add_generation_prompt:  # lm-eval prefills the assistant turn and continues it
        history.append({"role": "assistant", "content": "The answer is"})
    ours = astrai_lm.apply_chat_template(history, add_generation_prompt=add_generation_prompt)
    assert ours == hf_lm.apply_chat_template(history, add_generation_prompt=add_generation_prompt)
    assert ours.endswith("The answer is") != add_generation_prompt
    assert astrai_lm.chat_template(True) == astrai_lm.tokenizer.chat_template and astrai_lm.chat_template(False) is None


def test_local_tasks_agree_with_the_hf_backend(astrai_lm, model_dir, task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = ["tiny_mc", "tiny_rolling", "tiny_gen"]
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    ours = lm_eval.simple_evaluate(model=astrai_lm, tasks=tasks, task_manager=manager, log_samples=True)
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32,device=cpu",
                                     tasks=tasks, task_manager=manager, batch_size=4, log_samples=True)
    a, b = ours["results"], theirs["results"]
    assert a["tiny_mc"]["acc,none"] == b["tiny_mc"]["acc,none"]
    assert a["tiny_gen"]["exact_match,none"] == b["tiny_gen"]["exact_match,none"]
    assert math.isclose(a["tiny_rolling"]["word_perplexity,none"], b["tiny_rolling"]["word_perplexity,none"],
                        rel_tol=1e-4)
    for task in tasks:
        ours_resps = [s["filtered_resps"] for s in ours["samples"][task]]
        theirs_resps = [s["filtered_resps"] for s in theirs["samples"][task]]
        if task == "tiny_gen":
            assert ours_resps == theirs_resps
        else:
            flat = [(x, y) for r, s in zip(ours_resps, theirs_resps) for x, y in zip(r, s)]
            values = [(x[0] if isinstance(x, tuple | list) else x, y[0] if isinstance(y, tuple | list) else y)
                      for x, y in flat]
            assert max(abs(x - y) for x, y in values) < 1e-4
