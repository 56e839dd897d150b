"""Why an lm-eval task cannot run, in one line: the diagnoses behind `astrai eval --tasks` errors.

lm-eval skips a task YAML it cannot parse without a word (the task is then "not found"), and a
multiple-choice document whose `doc_to_choice` gives no choices, or something that is not a
list, fails deep inside lm-eval (an unpacking ValueError, a TypeError, an IndexError). The CLI
(cli.py) asks these functions only once something has gone wrong, so a healthy run pays nothing:
`damaged_task_files` names the YAML files of an `--include_path` that cannot be read, and
`bad_choices` names the task and document whose choices are unusable. lm-eval is imported only
by `bad_choices`, which receives lm-eval's own task manager.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as lm-eval's task index walks a folder


class _AnyTagLoader(yaml.SafeLoader):
    """A safe loader that reads lm-eval's `!function` (and any other) tags as plain values: only
    whether the file parses is asked here, nothing in it is imported or run."""


_AnyTagLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def damaged_task_files(include_path: str | Path) -> list[str]:
    """One line per task YAML under `include_path` that lm-eval's index would skip: not UTF-8, not
    YAML, or not a mapping; empty when every file reads."""
    problems = []
    for path in sorted(Path(include_path).glob("**/*.yaml")):
        if any(part in SKIPPED_DIRS for part in path.parts):
            continue
        try:
            config = yaml.load(path.read_text(encoding="utf-8"), Loader=_AnyTagLoader)
        except UnicodeDecodeError as e:
            problems.append(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})")
            continue
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problems.append(f"{path} is not valid YAML ({getattr(e, 'problem', None) or e}{where})")
            continue
        if not isinstance(config, dict):
            problems.append(f"{path} holds a {type(config).__name__}, not a task's mapping of fields")
    return problems


def _tasks(node: Any) -> Iterator[Any]:
    """The task objects of lm-eval's (possibly nested, by group) task dict."""
    if isinstance(node, dict):
        for value in node.values():
            yield from _tasks(value)
    elif node is not None:
        yield node


def bad_choices(task_names: list[str], task_manager: Any) -> str | None:
    """The first multiple-choice document, over the named tasks, whose `doc_to_choice` is not a
    non-empty list of strings, as one line naming the task, the document and the fix; None when
    every document has choices."""
    from lm_eval.tasks import get_task_dict

    for task in _tasks(get_task_dict(task_names, task_manager)):
        if getattr(task, "OUTPUT_TYPE", None) != "multiple_choice":
            continue
        name = getattr(getattr(task, "config", None), "task", None) or type(task).__name__
        for index, doc in enumerate(task.eval_docs):
            try:
                choices = task.doc_to_choice(doc)
            except Exception as e:  # the task's own template or function failed on this document
                return (f"lm-eval task {name}: doc_to_choice fails on document {index} ({type(e).__name__}: {e}); "
                        "fix the task's doc_to_choice or that document")
            if isinstance(choices, list | tuple) and choices and all(isinstance(c, str) for c in choices):
                continue
            found = "no choices" if isinstance(choices, list | tuple) and not choices else f"{choices!r:.60}"
            return (f"lm-eval task {name}: document {index} has {found} from doc_to_choice; a multiple_choice "
                    "task needs a non-empty list of strings for every document: fix that document or the task's "
                    "doc_to_choice")
    return None
