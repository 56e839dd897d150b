"""Evaluation: exact match on prompt records (exact.py), lm-eval tasks in-process through the
adapter (harness.py, which alone imports the optional lm_eval), perplexity (perplexity.py), all
scored on the inference engine (scoring.py); `astrai eval` is cli.py."""

from __future__ import annotations

from astrai.data.tasks import SCORERS
from astrai.eval.exact import EvalResult, evaluate_model, read_prompt_records

__all__ = ["SCORERS", "EvalResult", "evaluate_model", "read_prompt_records"]
