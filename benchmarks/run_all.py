"""Run every benchmark (what `make bench` does); pass --quick for a short smoke run."""

from __future__ import annotations

import sys

from astrai.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
