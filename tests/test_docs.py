"""The docs describe the code that exists: config tables, modules and commands are checked both ways.

Reference tables in docs/ have the header ``| field | section | type | default | meaning |``. Every
field of the documented dataclasses must have exactly one row with its section, type, default and
range (the field's ``knob`` metadata, stated as "Range: `>= 1`."), and every row must name a field
that exists. Every ``astrai <command>`` shown in code in README.md
or docs/ must be a command of ``src/astrai/cli.py`` (and its sub-command and ``--flags`` must exist).
The module table of docs/architecture.md must list exactly the modules under ``src/astrai/``, and its
import table's "must not import" rules must hold in the source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from astrai import config as run_config
from astrai.cli import COMMANDS
from astrai.infer.config import EngineConfig
from astrai.infer.sampling import SamplingParams
from astrai.model.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

# which dataclass each (file, section) of a reference table documents
DOCUMENTED: dict[str, dict[str, type]] = {
    "training.md": {"model": ModelConfig, **run_config.SECTIONS},
    "inference.md": {"engine": EngineConfig, "sampling": SamplingParams},
}
TABLE_HEADER = re.compile(r"^\|\s*field\s*\|\s*section\s*\|\s*type\s*\|\s*default\s*\|\s*meaning\s*\|\s*$")


@dataclasses.dataclass(frozen=True)
class Row:
    field: str
    section: str
    type: str
    default: str
    line: int
    meaning: str = ""


def _cells(line: str) -> list[str]:
    """Cells of a table row; a '|' inside a cell is escaped as '\\|' (GitHub's rule)."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def _unquote(cell: str) -> str:
    return cell.strip().strip("`").strip()


def reference_rows(path: Path) -> list[Row]:
    """Rows of every ``| field | section | type | default | meaning |`` table in a file."""
    rows: list[Row] = []
    in_table = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if TABLE_HEADER.match(line):
            in_table = True
            continue
        if not in_table:
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if set("".join(cells)) <= set("-: "):  # the |---| separator
            continue
        assert len(cells) == 5, (f"{path.name}:{n}: a reference row needs 5 cells (escape a '|' inside a "
                                 f"cell as '\\|'), got {len(cells)}: {line!r}")
        rows.append(Row(*(_unquote(c) for c in cells[:4]), n, cells[4]))
    return rows


def type_name(tp: Any) -> str:
    """How a field's type is written in the docs: `int | None`, `dict[str, Any] | None`."""
    text = tp.__name__ if isinstance(tp, type) else str(tp)
    return text.replace("typing.", "")


def code_fields(cls: type) -> dict[str, tuple[str, Any]]:
    """name -> (type as documented, default) of a dataclass's public fields."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[f.name] = (type_name(hints[f.name]), default)
    return out


@pytest.mark.parametrize("doc", sorted(DOCUMENTED))
def test_every_field_is_documented_and_every_documented_field_exists(doc: str) -> None:
    rows = reference_rows(DOCS / doc)
    assert rows, f"docs/{doc} has no '| field | section | type | default | meaning |' table"
    documented = {}
    for row in rows:
        key = (row.section, row.field)
        assert key not in documented, f"docs/{doc}:{row.line}: {row.section}.{row.field} is documented twice"
        documented[key] = row
    expected = {(section, name) for section, cls in DOCUMENTED[doc].items() for name in code_fields(cls)}
    missing = sorted(expected - set(documented))
    unknown = sorted(set(documented) - expected)
    assert not missing, f"fields without a row in docs/{doc}: {[f'{s}.{n}' for s, n in missing]}"
    assert not unknown, (f"docs/{doc} documents fields that do not exist (or sit in another section): "
                         f"{[f'{s}.{n} (line {documented[(s, n)].line})' for s, n in unknown]}")


@pytest.mark.parametrize("doc", sorted(DOCUMENTED))
def test_documented_types_and_defaults_match_the_code(doc: str) -> None:
    for row in reference_rows(DOCS / doc):
        cls = DOCUMENTED[doc].get(row.section)
        if cls is None or row.field not in code_fields(cls):
            continue  # reported by the test above
        tp, default = code_fields(cls)[row.field]
        where = f"docs/{doc}:{row.line} ({row.section}.{row.field})"
        assert row.type == tp, f"{where}: type is {tp!r} in the code, {row.type!r} in the docs"
        # defaults are written as YAML: null, true, 0.001, 1.0e-8, out/ckpt, []
        assert yaml.safe_load(row.default) == default, (
            f"{where}: default is {default!r} in the code, {row.default!r} in the docs"
        )


@pytest.mark.parametrize("doc", sorted(DOCUMENTED))
def test_documented_ranges_are_the_fields_ranges(doc: str) -> None:
    """A field made with `astrai.flags.knob` and a range (the range config_checks, SamplingParams and
    the server enforce) says it in its row as "Range: `>= 1`."; a row without one says none."""
    for row in reference_rows(DOCS / doc):
        cls = DOCUMENTED[doc].get(row.section)
        found = {f.name: f for f in dataclasses.fields(cls)}.get(row.field) if cls else None
        if found is None:
            continue  # reported by the tests above
        within = found.metadata.get("range")
        stated = re.findall(r"Range: `([^`]*)`", row.meaning)
        where = f"docs/{doc}:{row.line} ({row.section}.{row.field})"
        assert stated == ([within.text()] if within else []), (
            f"{where}: the code's range is {within.text() if within else 'none'!r}, the docs state {stated}")


def test_reference_parser_reads_escaped_pipes(tmp_path: Path) -> None:
    """A row whose cells hold escaped '|' gives the right cells (the parser is not vacuous)."""
    probe = tmp_path / "probe.md"
    probe.write_text("| field | section | type | default | meaning |\n|---|---|---|---|---|\n"
                     "| `max_steps` | train | `int \\| None` | `null` | steps; `a \\| b` |\n\nprose\n| x | y |\n")
    assert reference_rows(probe) == [Row("max_steps", "train", "int | None", "null", 3, "steps; `a | b`")]


# ---------------------------------------------------------------------------- commands


def code_snippets(text: str) -> list[str]:
    """Lines of fenced code blocks and inline code spans: where commands are shown."""
    snippets, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            snippets.append(line.split(" #")[0])  # a trailing shell comment is prose
        else:
            snippets += [s.replace("\\|", "|") for s in re.findall(r"`([^`]+)`", line)]
    return snippets


# `astrai <command>` where a shell command starts: at the start of a snippet (after an optional
# `$ ` prompt), after `python -m` / `torchrun -m`, `;`, `&&`, `|`, `(`, or a path (`.venv/bin/astrai`).
# Not `ruff check astrai tests` (a path argument) or `from astrai import X` (Python).
COMMAND_USE = re.compile(r"(?:^\s*(?:\$\s+)?|-m\s+|[;&|(]\s*|/)astrai ([a-z][\w-]*)(.*)$")


def command_uses() -> list[tuple[str, str, str]]:
    """(file, command, rest of the line) for every `astrai <command>` shown in code."""
    uses = []
    for path in DOC_FILES:
        for snippet in code_snippets(path.read_text()):
            for m in COMMAND_USE.finditer(snippet):
                uses.append((path.name, m.group(1), m.group(2)))
    return uses


def test_command_pattern_finds_shell_commands_only() -> None:
    shown = ["astrai train --config x.yaml", "$ astrai serve --model m", "python -m astrai demo",
             "torchrun --nproc_per_node 2 -m astrai train", "make setup && astrai ckpt list d",
             ".venv/bin/astrai eval --model m"]
    prose = ["ruff check astrai tests benchmarks", "from astrai import LLM", "import astrai", "astrai.load_model"]
    assert [COMMAND_USE.search(s).group(1) for s in shown] == ["train", "serve", "demo", "train", "ckpt", "eval"]
    assert [COMMAND_USE.search(s) for s in prose] == [None] * len(prose)


def help_text(command: str, *sub: str) -> str:
    """The --help output of `astrai <command> [sub]`, run in-process."""
    from astrai.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, *sub, "--help"])
    return out.getvalue()


def known_flags(command: str, sub: str | None) -> set[str]:
    if command == "train":  # every config field is a flag, on top of the parser's own
        return set(run_config.field_table()) | {"config", "dry_run", "help"}
    text = help_text(command, *([sub] if sub else []))
    return set(re.findall(r"--([a-z][\w-]*)", text)) | {"help"}


def subcommands(command: str) -> set[str]:
    usage = help_text(command).split("\n\n")[0]
    m = re.search(r"\{([\w,]+)\} \.\.\.", usage)  # argparse sub-parsers: `{list,verify} ...`
    return set(m.group(1).split(",")) if m else set()


def test_docs_show_commands_at_all() -> None:
    commands = {c for _, c, _ in command_uses()}
    assert {"train", "serve", "generate", "ckpt"} <= commands, f"commands shown in the docs: {sorted(commands)}"


def test_every_command_in_the_docs_exists() -> None:
    unknown = sorted({(f, c) for f, c, _ in command_uses() if c not in COMMANDS})
    assert not unknown, f"commands shown in the docs but missing from src/astrai/cli.py COMMANDS: {unknown}"


def test_sub_commands_and_flags_in_the_docs_exist() -> None:
    problems = []
    cache: dict[tuple[str, str | None], set[str]] = {}
    subs: dict[str, set[str]] = {}
    for doc, command, rest in command_uses():
        if command not in COMMANDS:
            continue  # reported by test_every_command_in_the_docs_exists
        if command not in subs:
            subs[command] = subcommands(command) if command != "train" else set()
        sub = None
        words = rest.split()
        if subs[command]:
            if words and not words[0].startswith("-"):
                shown = set(words[0].split("|"))  # `astrai ckpt list|verify`
                problems += [f"{doc}: astrai {command} {s}" for s in sorted(shown - subs[command])]
                sub = sorted(shown & subs[command])[0] if shown & subs[command] else None
        key = (command, sub)
        if key not in cache:
            cache[key] = known_flags(command, sub)
        flags = set(re.findall(r"(?:^|\s|\[)--([a-z][\w.-]*)", rest))
        if command == "train":  # the trainer also reads --max-lr and --optim.max_lr as max_lr
            flags = {f.split(".")[-1].replace("-", "_") for f in flags}
        problems += [f"{doc}: astrai {command}{' ' + sub if sub else ''} --{f}" for f in sorted(flags - cache[key])]
    assert not problems, f"sub-commands or flags shown in the docs that the CLI does not have: {problems}"


# ---------------------------------------------------------------------------- modules


def test_architecture_module_table_matches_the_package() -> None:
    """docs/architecture.md names every module under src/astrai/ (in backticks), and only those."""
    text = (DOCS / "architecture.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("|")]
    named = set(re.findall(r"`(src/astrai/[\w/]+\.py)`", "\n".join(table)))
    package = ROOT / "src" / "astrai"
    actual = {
        p.relative_to(ROOT).as_posix() for p in package.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts
    }
    assert actual, "no modules found under src/astrai/"
    assert not sorted(actual - named), f"modules missing from the docs/architecture.md table: {sorted(actual - named)}"
    assert not sorted(named - actual), f"docs/architecture.md names modules that do not exist: {sorted(named - actual)}"


def import_rules() -> dict[str, set[str]]:
    """layer -> layers it must not import, from the 'must not import' table of architecture.md."""
    rules = {}
    for line in (DOCS / "architecture.md").read_text().splitlines():
        m = re.match(r"^\|\s*`src/astrai/(\w+)`\s*\|[^|]*\|([^|]*)\|\s*$", line)
        if m:
            rules[m.group(1)] = {w.strip() for w in m.group(2).split(",") if w.strip()}
    return rules


def imported_layers(path: Path) -> set[str]:
    """The astrai sub-packages a module imports anywhere (top level or inside functions), also
    through the package: `from astrai import infer` and `from astrai import LLM` (a lazy re-export)."""
    import ast

    import astrai

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if isinstance(node, ast.ImportFrom) and node.module == "astrai":
            names = [astrai._EXPORTS.get(a.name, f"astrai.{a.name}") for a in node.names
                     if a.name in astrai._EXPORTS or (ROOT / "src" / "astrai" / a.name).is_dir()]
        for name in names:
            parts = name.split(".")
            if parts[0] == "astrai" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_import_direction_matches_architecture() -> None:
    rules = import_rules()
    assert set(rules) == {"model", "data", "infer", "serve", "train"}, f"import table rows: {sorted(rules)}"
    violations = []
    for layer, forbidden in rules.items():
        for path in sorted((ROOT / "src" / "astrai" / layer).rglob("*.py")):
            bad = imported_layers(path) & forbidden
            violations += [f"{path.relative_to(ROOT)} imports astrai.{b}" for b in sorted(bad)]
    assert not violations, f"imports against docs/architecture.md: {violations}"


# the one module of the train layer that may import the engine: the in-process sampler, through
# which rollouts and evaluation during training draw their turns
BRIDGE_MODULES = ("src/astrai/train/rl/engine_sampler.py",)


def test_only_the_bridge_module_of_train_imports_infer() -> None:
    """docs/architecture.md: inside src/astrai/train, only the in-process sampler imports astrai.infer."""
    text = (DOCS / "architecture.md").read_text()
    (bridge,) = BRIDGE_MODULES
    assert f"one module may import `astrai.infer`: `{bridge}`" in text, (
        f"docs/architecture.md no longer states that only {bridge} of the train layer imports "
        "astrai.infer; update the rule here and there together")
    modules = sorted((ROOT / "src" / "astrai" / "train").rglob("*.py"))
    assert modules, "no modules found under src/astrai/train/"
    violations = [p.relative_to(ROOT).as_posix() for p in modules
                  if p.relative_to(ROOT).as_posix() not in BRIDGE_MODULES and "infer" in imported_layers(p)]
    assert not violations, (f"{violations} import astrai.infer; only {BRIDGE_MODULES} may (rollouts and "
                            "evaluation go through them, see docs/architecture.md)")


def test_imported_layers_sees_every_import_form(tmp_path: Path) -> None:
    """The import checks are not vacuous: each way of reaching astrai.infer is found."""
    forms = ["import astrai.infer.engine", "from astrai.infer.llm import LLM", "from astrai import infer",
             "from astrai import LLM", "def f():\n    from astrai.infer import sampling"]
    for i, form in enumerate(forms):
        probe = tmp_path / f"probe{i}.py"
        probe.write_text(form + "\n")
        assert "infer" in imported_layers(probe), form
    clean = tmp_path / "clean.py"
    clean.write_text("import torch\nfrom astrai import __version__\nfrom astrai.model.hf import load_model\n")
    assert imported_layers(clean) == {"model"}


def test_train_help_names_every_built_in_reward() -> None:
    """`astrai train --help` lists the built-in rewards beside --rewards, final_number among them."""
    from astrai.train.rl.rewards import BUILTINS

    text = " ".join(help_text("train").split())
    for name in BUILTINS:
        assert name in text, f"astrai train --help does not name the built-in reward {name!r}"
