"""`astrai chat --model DIR`: an interactive conversation with a model in the terminal.

Each line read is a user turn; the conversation so far goes through the model's chat template
and the reply streams to the terminal as the engine produces it (`LLMEngine.add_request`, then
`step` until the request finishes, printing each new piece of text). The reply joins the history.
`/reset` forgets the conversation (the `--system` prompt stays), `/exit` or end of input leaves,
Ctrl-C stops a reply midway. When the history no longer fits in `max_model_len`, the oldest turns
are dropped, with a note. The sampling flags are `astrai generate`'s, one per SamplingParams field
(sampling_flags.py); those left unset take the model's generation_config.json defaults
(defaults.py), as in `astrai generate` and `astrai serve`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import fields
from itertools import count
from typing import TextIO

from astrai.flags import ArgumentParser
from astrai.infer.config import EngineConfig
from astrai.infer.defaults import describe, generation_defaults
from astrai.infer.engine import LLMEngine
from astrai.infer.generate import add_engine_arguments, check_model_dirs
from astrai.infer.sampling import SamplingParams
from astrai.infer.sampling_flags import add_sampling_arguments, sampling_params_from_args
from astrai.model.manifest import VERIFY_HELP

HELP = "/reset forgets the conversation, /exit leaves (or end of input), Ctrl-C stops a reply"
CHAT_DEFAULTS = {"max_tokens": 512}  # a reply, not SamplingParams' 16 tokens


class ChatSession:
    """A conversation with one engine: `reply(text, out)` streams the answer and keeps the history."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, system: str | None = None):
        if engine.tokenizer is None or not engine.tokenizer.chat_template:
            raise ValueError("chat needs a tokenizer with a chat template in the model directory")
        self.engine, self.params, self.system = engine, params, system
        self.history: list[dict[str, str]] = []
        self._ids = count()

    def reset(self) -> None:
        self.history = []

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def _prompt_ids(self, out: TextIO) -> list[int]:
        """The rendered conversation; the oldest turns go while it leaves no room for a reply."""
        tok = self.engine.tokenizer
        room = self.engine.max_model_len - min(self.params.max_tokens, self.engine.max_model_len // 2)
        ids = tok.apply_chat_template(self.messages(), add_generation_prompt=True, tokenize=True)
        while len(ids) > room and len(self.history) > 1:
            self.history = self.history[2:] if len(self.history) > 2 else self.history[-1:]
            print("[the oldest turn was dropped to fit max_model_len]", file=out)
            ids = tok.apply_chat_template(self.messages(), add_generation_prompt=True, tokenize=True)
        if len(ids) > room:
            raise ValueError(f"this message is {len(ids)} tokens with the template, more than the "
                             f"{room} that max_model_len {self.engine.max_model_len} leaves; shorten it")
        return ids

    def reply(self, text: str, out: TextIO) -> str:
        """Add the user's turn, stream the model's reply to `out`, add it to the history."""
        self.history.append({"role": "user", "content": text})
        try:
            prompt_ids = self._prompt_ids(out)
        except ValueError:
            self.history.pop()
            raise
        request_id = f"chat-{next(self._ids)}"
        self.engine.add_request(request_id, prompt_ids, self.params, with_logprobs=False)
        shown = ""
        try:
            finished = False
            while not finished:
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    text_now = output.outputs[0].text
                    if text_now != shown:
                        out.write(text_now[len(shown):])
                        out.flush()
                    shown, finished = text_now, output.finished
        except KeyboardInterrupt:
            self.engine.abort(request_id)
            out.write(" [stopped]")
        out.write("\n")
        out.flush()
        self.history.append({"role": "assistant", "content": shown})
        return shown


def run(session: ChatSession, lines: Iterable[str], out: TextIO, prompt: str = ">>> ") -> None:
    """The read-reply loop over `lines` (stdin, or a list in tests)."""
    print(f"chatting ({HELP})", file=out)
    lines = iter(lines)
    while True:
        out.write(prompt)
        out.flush()
        line = next(lines, None)
        if line is None:
            out.write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            print("[conversation reset]", file=out)
        elif text.startswith("/") and text in ("/help", "/?"):
            print(HELP, file=out)
        else:
            try:
                session.reply(text, out)
            except ValueError as exc:
                print(f"error: {exc}", file=out)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="astrai chat", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", required=True, help="model or checkpoint directory with a tokenizer and chat template, or a "
                   "run's ckpt_dir (its newest complete checkpoint)")
    p.add_argument("--system", default=None, help="system prompt, kept across /reset")
    p.add_argument("--verify", action="store_true", default=None, help=VERIFY_HELP)
    add_sampling_arguments(p, CHAT_DEFAULTS)
    add_engine_arguments(p)
    return p


def main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        from astrai.model.hf_dir import check_device
        from astrai.model.lora import split_adapter
        from astrai.model.manifest import model_argument

        # a Hub id -> its cached snapshot; a run's ckpt_dir -> its newest checkpoint
        args.model = model_argument(args.model, "astrai chat")
        args.model, args.lora = split_adapter(args.model, args.lora, "astrai chat")  # a LoRA checkpoint
        check_device(args.device)
        check_model_dirs(args)
        defaults = generation_defaults(args.model, args.generation_config)
        if defaults:
            print(describe(defaults), file=sys.stderr)
        params = sampling_params_from_args(args, defaults)
        engine = LLMEngine.from_pretrained(args.model, **{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
        session = ChatSession(engine, params, args.system)
    except (ValueError, FileNotFoundError) as exc:
        print(f"astrai chat: {exc}", file=sys.stderr)
        return 2
    try:
        run(session, stdin, stdout, prompt=">>> " if stdin.isatty() else "")
    except KeyboardInterrupt:
        stdout.write("\n")
    return 0
