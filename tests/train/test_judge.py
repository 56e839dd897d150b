"""The `judge` reward: a chat server's number is the score; garbage, errors and timeouts score None
and are counted in `judge_failures`; 429/5xx are retried; identical requests are asked once; it
works against `astrai serve`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from astrai.config import RLConfig, load_config
from astrai.config_values import ConfigError
from astrai.train.rl import judge as judge_module
from astrai.train.rl.judge import Judge, parse_score
from astrai.train.rl.rewards import RewardSet


class StubJudge:
    """A chat-completions server in a thread: `answer(body, attempt)` -> (status, reply text)."""

    def __init__(self, answer):
        self.answer, self.bodies, self.headers, self.attempts = answer, [], [], {}
        self.release = threading.Event()  # a request that hangs waits for this
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, {"data": [{"id": "stub-judge"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][0]["content"]
                stub.bodies.append(body)
                stub.headers.append(dict(self.headers))
                stub.attempts[text] = stub.attempts.get(text, 0) + 1
                status, reply = stub.answer(text, stub.attempts[text])
                if status == "hang":
                    stub.release.wait(30)  # guard only: the client's timeout ends the wait first
                    return
                self._send(status, {"choices": [{"message": {"role": "assistant", "content": reply}}]})

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    monkeypatch.setattr(judge_module, "BACKOFF_S", 0.0)


def rl(url, **kw) -> RLConfig:
    return RLConfig(rewards=["judge"], judge_url=url, **kw)


def score(judge_or_set, completions, answers=None):
    records = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": a}
               for i, a in enumerate(answers or ["7"] * len(completions))]
    if isinstance(judge_or_set, RewardSet):
        return judge_or_set(["p"] * len(completions), completions, records, [[1]] * len(completions), 1,
                            completion_ids=[[1]] * len(completions))
    return judge_or_set(prompts=[r["messages"] for r in records],
                        completions=[[{"role": "assistant", "content": c}] for c in completions],
                        answer=[r["answer"] for r in records])


def test_parse_score_takes_the_first_number():
    assert parse_score("Score: 7/10") == 7.0 and parse_score("-1.5") == -1.5
    assert parse_score("no idea") is None and parse_score("") is None


def test_a_judge_answering_garbage_scores_none_and_counts_failures():
    with StubJudge(lambda text, n: (200, "I cannot rate that")) as stub:
        total, terms = score(RewardSet(rl(stub.url)), ["a", "b", "c"])
    assert terms["judge_failures"].tolist() == [1.0, 1.0, 1.0]
    assert terms["judge"].tolist() == [0.0, 0.0, 0.0] and total.tolist() == [0.0, 0.0, 0.0]
    assert stub.bodies[0]["model"] == "stub-judge" and stub.bodies[0]["temperature"] == 0.0


def test_numbers_are_scores_and_identical_requests_are_asked_once():
    prompt = "{prompt}|{completion}|{answer}"
    with StubJudge(lambda text, n: (200, "8" if text.endswith("|7") else "Score: 2")) as stub:
        judge = Judge(rl(stub.url, judge_prompt=prompt))
        scores = score(judge, ["x", "x", "y", "x"], answers=["7", "7", "7", "1"])
    # rows 0 and 1 render the same request (q0|x|7 and q1|x|7 differ by prompt: four distinct)
    assert scores == [8.0, 8.0, 8.0, 2.0]
    assert judge.num_requests == len(stub.bodies) == 4
    with StubJudge(lambda text, n: (200, "5")) as stub:
        judge = Judge(rl(stub.url, judge_prompt="{completion}"))
        assert score(judge, ["x", "x", "y", "x"]) == [5.0] * 4
    assert judge.num_requests == len(stub.bodies) == 2  # "x" asked once


def test_rate_limits_and_server_errors_are_retried_then_give_none():
    with StubJudge(lambda text, n: (429, "") if n == 1 else (200, "6")) as stub:
        assert score(Judge(rl(stub.url)), ["a"]) == [6.0]
        assert len(stub.bodies) == 2
    with StubJudge(lambda text, n: (500, "")) as stub:
        assert score(Judge(rl(stub.url)), ["a"]) == [None]
        assert len(stub.bodies) == judge_module.RETRIES + 1
    with StubJudge(lambda text, n: (400, "")) as stub:  # a client error is not asked again
        assert score(Judge(rl(stub.url)), ["a"]) == [None]
        assert len(stub.bodies) == 1


def test_a_request_past_reward_timeout_scores_none(monkeypatch):
    monkeypatch.setattr(judge_module, "RETRIES", 0)
    with StubJudge(lambda text, n: ("hang", "")) as stub:
        assert score(Judge(rl(stub.url, reward_timeout=0.2)), ["a"]) == [None]


def test_the_api_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sekrit")
    with StubJudge(lambda text, n: (200, "1")) as stub:
        score(Judge(rl(stub.url, judge_api_key_env="MY_JUDGE_KEY")), ["a"])
    assert stub.headers[-1]["Authorization"] == "Bearer sekrit"
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(ValueError, match="judge_api_key_env='MY_JUDGE_KEY' names an environment variable that is not"):
        Judge(rl("http://127.0.0.1:9", judge_api_key_env="MY_JUDGE_KEY"))


def test_bad_judge_settings_are_refused():
    with pytest.raises(ConfigError, match="rewards has judge but judge_url is not set"):
        load_config(None, ["--train_type", "online_grpo", "--rewards", "judge"])
    with pytest.raises(ValueError, match="judge_prompt .* is not a template"):
        Judge(rl("http://127.0.0.1:9", judge_prompt="{question}"))


def test_the_judge_works_against_astrai_serve(tmp_path, tok_dir, monkeypatch):
    from astrai.data.tokenizer import load_tokenizer
    from astrai.model.config import ModelConfig
    from astrai.model.hf import save_model
    from astrai.model.transformer import CausalLM
    from astrai.serve.state import ServeConfig
    from tests.serve.conftest import API_KEY
    from tests.serve.live import SERVER_ENGINE, LiveServer
    from tests.train.resume_data import MODEL

    model_dir = tmp_path / "served-judge"
    save_model(CausalLM(ModelConfig(**MODEL), seed=5), model_dir, load_tokenizer(tok_dir))
    monkeypatch.setenv("JUDGE_KEY", API_KEY)
    with LiveServer(ServeConfig(str(model_dir), api_key=API_KEY, engine_kwargs=dict(SERVER_ENGINE))) as server:
        rewards = RewardSet(rl(server.base, judge_prompt="{prompt}={completion}", judge_concurrency=2,
                               judge_api_key_env="JUDGE_KEY"))
        total, terms = score(rewards, ["12", "12", "3"])
        with pytest.raises(ValueError, match="answered 401 .unauthorized.; set judge_api_key_env"):
            score(RewardSet(rl(server.base)), ["12"])  # a server that wants a key: an error, not a run of Nones
    judge = rewards.functions[0]
    assert judge.num_requests == 3 and judge.model == "served-judge"  # the served model's name (its directory)
    # a random model's reply may hold no number: each completion has a score or is counted as failed
    failed = terms["judge_failures"].bool()
    assert torch.equal(terms["judge"][failed], torch.zeros(int(failed.sum())))
    assert total.shape == (3,) and bool(torch.isfinite(total).all())
