"""`astrai bench`: run the side-by-side benchmarks in `benchmarks/` and print their tables.

The benchmarks compare astrai with its peers (transformers, TRL) in the same process and
report ratios; they need the dev extra installed and a source checkout (they are scripts, not
part of the installed package).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from astrai.flags import ArgumentParser

BENCHMARKS = ["model", "preprocess", "train", "checkpoint", "generate", "serve", "hostile", "rl", "lora", "guided", "eval",
              "compare_trl"]


def benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test of the scripts)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    folder = benchmarks_dir()
    if not folder.is_dir():
        print(f"astrai bench: no benchmarks/ folder next to the package ({folder}); "
              "run it from a source checkout", file=sys.stderr)
        return 2
    failed = []
    for name in args.names or BENCHMARKS:
        script = folder / (f"{name}.py" if name.startswith("compare_") else f"bench_{name}.py")
        if not script.exists():
            print(f"astrai bench: {script.name} is missing", file=sys.stderr)
            failed.append(name)
            continue
        print(f"\n## {name}\n", flush=True)
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        if subprocess.call(cmd) != 0:
            failed.append(name)
    if failed:
        print(f"astrai bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
