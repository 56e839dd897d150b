"""Packaging: the package lives under src/, so a clone that sits in the working directory (a folder
named `astrai` without an `__init__.py`) is never imported as a namespace package in place of the
installed one; and the project metadata builds without setuptools deprecation warnings."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import astrai

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_is_under_src() -> None:
    assert Path(astrai.__file__).resolve() == ROOT / "src" / "astrai" / "__init__.py"
    assert not (ROOT / "astrai").exists(), "a top-level astrai/ folder would shadow the package again"


def test_a_clone_named_astrai_in_the_working_directory_is_not_imported(tmp_path: Path) -> None:
    # what `cd ~/code && python script.py` sees when the repository was cloned as ~/code/astrai
    (tmp_path / "astrai" / "src").mkdir(parents=True)
    (tmp_path / "astrai" / "README.md").write_text("a clone\n")
    code = "import astrai, astrai.cli; print(astrai.__file__); print(astrai.cli.__name__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.split()
    assert Path(first).resolve() == ROOT / "src" / "astrai" / "__init__.py"
    assert second == "astrai.cli"


def test_project_metadata_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(meta["project"]["license"], str), "license must be an SPDX expression (PEP 639)"
    code = ("import warnings, os; warnings.simplefilter('error'); "
            "from setuptools import build_meta; os.chdir(os.environ['ROOT']); "
            "print(build_meta.prepare_metadata_for_build_wheel(os.environ['OUT']))")
    env = {"ROOT": str(ROOT), "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    dist_info = tmp_path / r.stdout.split()[-1]
    assert "License-Expression: Apache-2.0" in (dist_info / "METADATA").read_text()
