"""The package's shape: no import cycle between modules (imports inside functions count; only
``if TYPE_CHECKING:`` blocks are left out) and no module over the ~500-line budget of STYLE.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "astrai"
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str], name: str | None = None) -> set[str]:
    """The astrai modules `path` imports anywhere in its body, TYPE_CHECKING blocks aside. A name
    imported from a package counts as its submodule when one exists (`from astrai.train import dist`)."""
    found: set[str] = set()
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    modules = set(paths)
    return {name: imports_of(path, modules) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := dfs(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)):
            return cycle
    return None


def test_no_import_cycles_between_modules() -> None:
    graph = import_graph()
    # a package's __init__ that re-exports its submodules is not a cycle with them: the edge from
    # a submodule to its own package is the package's re-export, not a dependency
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_deferred_imports_and_skips_type_checking(tmp_path: Path) -> None:
    modules = {"astrai.a", "astrai.b"}
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from astrai.b import g\n")
    b = tmp_path / "b.py"
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from astrai import a\nimport astrai.a\n")
    graph = {"astrai.a": imports_of(a, modules, "astrai.a"), "astrai.b": imports_of(b, modules, "astrai.b")}
    assert find_cycle(graph) in (["astrai.a", "astrai.b", "astrai.a"], ["astrai.b", "astrai.a", "astrai.b"])
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import astrai.a\n")
    graph["astrai.b"] = imports_of(b, modules, "astrai.b")
    assert find_cycle(graph) is None


def test_no_module_over_the_line_budget() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    over = {path: n for path, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them, STYLE.md 11): {over}"



TESTS = ROOT / "tests"
USER_CODE_PATH = re.compile(r"^(tests(?:\.\w+)+):\w+$")  # how a run names user code: rewards, tools, environments


def taken_from_test_modules(source: str, own: str) -> list[str]:
    """The test modules (`test_*`) other than `own` (a dotted name, `tests.train.test_rl`) that
    `source` takes from: imports of any form, anywhere, and the user-code paths
    (`"tests.train.test_x:reward"`) that a run it starts would import."""
    package = own.rpartition(".")[0].split(".")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` above this module's own
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and USER_CODE_PATH.match(node.value):
            names = [node.value.partition(":")[0]]
        else:
            continue
        found += [n for n in names if n.rpartition(".")[2].startswith("test_") and n != own]
    return found


def test_no_test_imports_another_test_module() -> None:
    """Shared fixtures live in a conftest.py and shared helpers in plain modules (STYLE.md 22):
    no test module imports another, nor names another's user code in the runs it starts."""
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if "__pycache__" not in path.parts and (names := taken_from_test_modules(path.read_text(), own)):
            found[path.relative_to(ROOT).as_posix()] = names
    assert not found, f"test modules that take from other test modules (move what they share): {found}"


def test_the_test_module_check_sees_every_form() -> None:
    own = "tests.train.test_probe"
    for form in ["from tests.train.test_rl import write_rl_run", "import tests.serve.test_tools",
                 "from tests.train import test_rl", "from .test_rl import x", "from ..serve.test_tools import ASK",
                 "def f():\n    from tests.a.test_b import c", 'REWARD = "tests.train.test_rl:bad_reward"']:
        assert taken_from_test_modules(form + "\n", own), form
    for clean in ["from tests.train.rl_runs import write_rl_run", 'SELF = "tests.train.test_probe:reward"',
                  "import pytest", "from tests.serve.conftest import API_KEY", "from . import rl_runs"]:
        assert not taken_from_test_modules(clean + "\n", own), clean
