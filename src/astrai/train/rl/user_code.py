"""User code named in the config: ``module:name`` -> the object, for rewards, environments and tools.

The one loader of a run's user code (``rl/rewards.py``, ``rl/environments.py``): it resolves the
module against the working directory however astrai was started, and turns every way an import
can fail into one line naming the entry, the module and the fix.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_user_object(spec: str, kind: str, expected: str) -> Any:
    """The object ``module:name`` names, imported with the working directory on sys.path: the
    console script's sys.path[0] is its bin directory, not the working directory as for
    ``python -m astrai``. `kind` (reward, environment, tool) and `expected` (what to define)
    word the errors. Shared by rewards, environments and tools."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{kind} {spec!r} is not module:name; write it as mymod:{attr or 'name'} (mymod.py in the "
                         f"working directory or on PYTHONPATH, {attr or 'name'} defined in it)")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does, so every way of starting astrai resolves alike
    importlib.invalidate_caches()  # a module written after the directory was first scanned
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} failed ({e}); install what it "
                             "imports") from e
        raise ValueError(f"{kind} {spec!r}: no module {module_name!r} in the working directory {cwd} or on "
                         f"PYTHONPATH; run astrai from the directory that holds {module_name.replace('.', '/')}.py "
                         "or add that directory to PYTHONPATH") from e
    except (Exception, SystemExit) as e:  # a SyntaxError, or the module's own code failing on import
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
        raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} {' '.join(what.split())}{where}; fix "
                         "the module (python -c 'import " + module_name + "' shows the traceback)") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                         f"attribute {attr!r}; define {expected} named {attr} there")
    return obj
