"""`astrai eval --data`: the scorer is chosen by --match; scoring runs on whatever the engine answered."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from astrai.eval import evaluate_model
from astrai.eval.cli import main

RECORDS = [{"messages": [{"role": "user", "content": q}], "answer": a}
           for q, a in [("3+4", "7"), ("2+2", "4"), ("5+5", "10")]]


class ScriptedLLM:
    """Stands in for astrai.LLM: answers each chat with a fixed reply."""

    def __init__(self, replies: list[str]):
        self.replies = replies

    def chat(self, conversations, params):
        assert params.temperature == 0.0 and len(conversations) == len(self.replies)
        return [SimpleNamespace(outputs=[SimpleNamespace(text=r, token_ids=[1] * len(r))]) for r in self.replies]


@pytest.mark.parametrize("match, correct", [("exact", 1), ("final_number", 2)])
def test_match_chooses_the_verifier(match, correct):
    llm = ScriptedLLM(["7", "2 + 2 = 4.", "The answer is 11"])
    result = evaluate_model(llm, RECORDS, max_tokens=8, match=match)
    assert result.num_correct == correct and result.num_total == 3
    assert [s["correct"] for s in result.samples] == ([True, False, False] if match == "exact" else
                                                      [True, True, False])


def test_cli_reports_the_match_and_rejects_an_unknown_one(tmp_path, monkeypatch, capsys):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    monkeypatch.setattr("astrai.infer.llm.LLM", lambda model: ScriptedLLM(["7", "4", "3 + 7 = 10"]))
    assert main(["--model", "unused", "--data", str(data), "--match", "final_number"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["match"] == "final_number" and out["num_correct"] == 3 and out["accuracy"] == 1.0
    with pytest.raises(SystemExit):
        main(["--model", "unused", "--data", str(data), "--match", "fuzzy"])
    assert "invalid choice: 'fuzzy'" in capsys.readouterr().err
