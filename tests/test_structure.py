"""The package's shape: no import cycle between modules (imports inside functions count; only
``if TYPE_CHECKING:`` blocks are left out), no module over the 600-line limit of STYLE.md, no
private name imported across modules, and no re-export: no module that only re-exports, and no
module that passes on a name it imports (listed in `__all__`, or imported and never used).
Importers take a name from the module that defines it. Only src/astrai is checked, as
../shared/tools/structure.py does; tests may reach into what they test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "astrai"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_base(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module an import statement of module `name` (file `path`) imports from."""
    base = node.module or ""
    if not node.level:
        return base
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))


def imports_of(path: Path, modules: set[str], name: str | None = None) -> set[str]:
    """The astrai modules `path` imports anywhere in its body, TYPE_CHECKING blocks aside. A name
    imported from a package counts as its submodule when one exists (`from astrai.train import dist`)."""
    found: set[str] = set()
    name = name or module_name(path)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, name, path)
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


def module_paths() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def import_graph() -> dict[str, set[str]]:
    paths = module_paths()
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


# ---------------------------------------------------------------------------- private names and re-exports


def _is_astrai(base: str) -> bool:
    return base == "astrai" or base.startswith("astrai.")


def private_imports(path: Path, name: str | None = None) -> list[str]:
    """`from astrai.x import _name` (one leading underscore) in module `name`, anywhere: inside
    functions and TYPE_CHECKING blocks too. A name two modules need is public where it lives."""
    name = name or module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = import_base(node, name, path)
            if _is_astrai(base) and base != name:
                found += [f"{name} imports {base}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements a module runs on import: its body, and the bodies of top-level if/try."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.Try):
            out += _top_level(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                out += _top_level(handler.body)
    return out


def _declared_all(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return names


def only_reexports(path: Path, name: str | None = None) -> bool:
    """A module (package __init__ and __main__ aside) that defines nothing and imports from astrai,
    or whose body, docstring, `from __future__` and `__all__` aside, is imports alone."""
    if path.name in ("__init__.py", "__main__.py"):
        return False
    name = name or module_name(path)
    tree = ast.parse(path.read_text())
    defines = any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) for n in tree.body)
    from_astrai = any(isinstance(n, ast.ImportFrom) and _is_astrai(import_base(n, name, path)) for n in tree.body)
    rest = [n for n in tree.body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str))
            and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
            and not (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))]
    return (not defines and from_astrai) or (bool(rest) and all(isinstance(n, ast.Import | ast.ImportFrom) for n in rest))


def reexported_names(path: Path, name: str | None = None) -> list[str]:
    """Names module `name` imports from astrai at its top level and passes on: listed in its
    `__all__`, or never used in it (the `# noqa: F401 - re-exported` shim). Package __init__
    files are the package's public face and exempt."""
    if path.name in ("__init__.py", "__main__.py"):
        return []
    name = name or module_name(path)
    tree = ast.parse(path.read_text())
    bound = [a.asname or a.name for n in _top_level(tree.body)
             if isinstance(n, ast.ImportFrom) and _is_astrai(import_base(n, name, path)) for a in n.names]
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    declared = _declared_all(tree)
    return sorted(b for b in bound if b in declared or b not in used)


def test_no_private_name_is_imported_across_modules() -> None:
    found = [line for path in module_paths().values() for line in private_imports(path)]
    assert not found, f"private names imported from another module (make them public where they live): {found}"


def test_no_module_only_re_exports() -> None:
    found = sorted(name for name, path in module_paths().items() if only_reexports(path))
    assert not found, f"modules that only re-export (import from where the names live instead): {found}"


def test_no_module_passes_on_names_it_imports() -> None:
    found = {name: names for name, path in sorted(module_paths().items()) if (names := reexported_names(path))}
    assert not found, f"modules re-exporting imported names (importers should import from where they live): {found}"


def test_the_re_export_and_private_rules_find_what_they_name(tmp_path: Path) -> None:
    pkg = tmp_path / "astrai" / "x"
    pkg.mkdir(parents=True)

    def module(file: str, text: str) -> Path:
        path = pkg / file
        path.write_text(text)
        return path

    deferred = module("a.py", "def f():\n    from astrai.y import _helper\n    from . import _peer\n"
                              "    from astrai.y import __version__\n    return _helper, _peer, __version__\n")
    assert private_imports(deferred, "astrai.x.a") == ["astrai.x.a imports astrai.y._helper",
                                                       "astrai.x.a imports astrai.x._peer"]
    shim = module("b.py", '"""Doc."""\nfrom __future__ import annotations\n\nfrom astrai.y import f, g\n'
                          '__all__ = ["f", "g"]\n')
    assert only_reexports(shim, "astrai.x.b") and reexported_names(shim, "astrai.x.b") == ["f", "g"]
    partial = module("c.py", "from astrai.y import f, g  # noqa: F401\nfrom astrai.z import h\n"
                             "__all__ = ['T', 'h']\n\nclass T:\n    x = f()\n")
    assert not only_reexports(partial, "astrai.x.c")
    assert reexported_names(partial, "astrai.x.c") == ["g", "h"]
    clean = module("d.py", "from astrai.y import f\n\ndef g():\n    return f()\n")
    assert not only_reexports(clean, "astrai.x.d") and not reexported_names(clean, "astrai.x.d")
    assert not private_imports(clean, "astrai.x.d")
    init = module("__init__.py", "from astrai.x.d import g\n__all__ = ['g']\n")
    assert not only_reexports(init, "astrai.x") and not reexported_names(init, "astrai.x")

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
