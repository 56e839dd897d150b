"""`astrai chat`: a REPL over stdin/stdout that streams replies, keeps the history and forgets it
on /reset; every reply equals what the offline `LLM.chat` gives for the same conversation (greedy)."""

from __future__ import annotations

import io

import pytest

from astrai.infer import chat
from astrai.infer.engine import LLMEngine
from astrai.infer.llm import LLM
from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Writes(io.StringIO):
    """stdout that also counts the writes, to see a reply arrive in pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []

    def write(self, s: str) -> int:
        self.pieces.append(s)
        return super().write(s)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    from astrai.model.hf import save_model

    out = tmp_path_factory.mktemp("chat_model")
    save_model(tiny_model(seed=5, vocab_size=320), out, tokenizer=tok)
    return out


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, kv_cache_tokens=1024)


def offline_reply(llm: LLM, messages: list[dict]) -> str:
    return llm.chat([messages], GREEDY)[0].outputs[0].text


def test_replies_stream_keep_history_and_reset(model_dir, llm):
    engine = LLMEngine.from_pretrained(model_dir, kv_cache_tokens=1024)
    session = chat.ChatSession(engine, GREEDY, system="be brief")
    out = Writes()
    chat.run(session, ["Hello there", "", "And again?", "/reset", "Hello there", "/exit", "never read"], out, "> ")
    first = offline_reply(llm, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}])
    second = offline_reply(llm, [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
                                 {"role": "user", "content": "And again?"}])
    assert first and second
    text = out.getvalue()
    assert text.splitlines()[1:] == [f"> {first}", "> > " + second, "> [conversation reset]", f"> {first}", "> "]
    # streamed: the first reply's text arrived in more than one write
    start = out.pieces.index("> ") + 1
    reply_pieces = [p for p in out.pieces[start : out.pieces.index("\n", start)] if p]
    assert len(reply_pieces) > 1 and "".join(reply_pieces) == first
    assert session.history == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first}]


def test_the_oldest_turns_go_when_the_history_outgrows_max_model_len(model_dir):
    engine = LLMEngine.from_pretrained(model_dir, kv_cache_tokens=1024, max_model_len=64)
    session = chat.ChatSession(engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    out = io.StringIO()
    chat.run(session, ["one two three four five six seven"] * 4, out)
    assert "[the oldest turn was dropped to fit max_model_len]" in out.getvalue()
    assert len(session.history) < 8


def test_main_reads_stdin_and_exits_at_end_of_input(model_dir, capsys):
    stdin, stdout = io.StringIO("Hello\n/help\n"), io.StringIO()
    argv = ["--model", str(model_dir), "--temperature", "0", "--max_tokens", "3", "--kv_cache_tokens", "512"]
    assert chat.main(argv, stdin=stdin, stdout=stdout) == 0
    lines = stdout.getvalue().splitlines()
    assert lines[0].startswith("chatting") and chat.HELP in lines


def test_a_model_without_a_chat_template_is_refused(tmp_path, capsys):
    from astrai.model.hf import save_model

    save_model(tiny_model(), tmp_path)  # no tokenizer at all
    assert chat.main(["--model", str(tmp_path)], stdin=io.StringIO("")) == 2
    assert "astrai chat:" in capsys.readouterr().err
