"""`python -m astrai` is the `astrai` console script."""

from astrai.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
