"""`python -m megascale ...`: the same command line as the `megascale` console script."""

from megascale.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
