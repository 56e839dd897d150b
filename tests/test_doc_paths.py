"""No doc names a file the repository lacks: every repository path in README.md and docs/*.md
(`src/astrai/...`, `configs/...`, `tests/...`, ...) and every relative Markdown link must exist.
Paths a run creates (`out/...`, `.cache/...`, `.venv`) are not repository paths and are skipped."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = ("src", "astrai", "configs", "docs", "tests", "scripts", "docker", "benchmarks", ".ci")
REPO_PATH = re.compile(rf"(?<![\w./$-])((?:{'|'.join(re.escape(d) for d in TOP_DIRS)})/[\w.*/-]*[\w*])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def named_paths(text: str) -> set[str]:
    """Repository paths named in a doc's text (Python module paths like `astrai.model` are not)."""
    return {m.group(1).rstrip(".") for m in REPO_PATH.finditer(text)}


def linked_paths(doc: Path, text: str) -> set[Path]:
    """Targets of relative Markdown links, resolved against the doc's folder."""
    out = set()
    for target in LINK.findall(text):
        target = target.split("#", 1)[0]
        if target and not re.match(r"^[a-z]+:", target):
            out.add((doc.parent / target).resolve())
    return out


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_every_repository_path_in_the_docs_exists() -> None:
    missing = []
    for doc in DOC_FILES:
        text = doc.read_text(encoding="utf-8")
        missing += [f"{doc.relative_to(ROOT)}: {p}" for p in sorted(named_paths(text)) if not _exists(p)]
        missing += [f"{doc.relative_to(ROOT)}: link {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}"
                    for p in sorted(linked_paths(doc, text)) if not p.exists()]
    assert not missing, "docs name files the repository lacks:\n" + "\n".join(missing)


def test_the_scanner_finds_paths_and_links(tmp_path: Path) -> None:
    text = ("see `src/astrai/model/hf.py`, configs/sft.yaml. and tests/x/*.py; not out/data/x.jsonl, "
            "$HOME/astrai/y or astrai.model.hf; [a](training.md#config) [b](https://x.org/a.md)")
    assert named_paths(text) == {"src/astrai/model/hf.py", "configs/sft.yaml", "tests/x/*.py"}
    assert linked_paths(tmp_path / "doc.md", text) == {(tmp_path / "training.md").resolve()}
    assert not _exists("src/astrai/no_such_module.py") and _exists("src/astrai/model/*.py")
    assert not _exists("astrai/model/hf.py")  # the package lives under src/; a stale path is caught
