#!/usr/bin/env python
"""Print the parameter table of docs/architecture.md, or rewrite it there with --write.

The table is rendered from the real model built on the meta device
(megascale.model.param_docs); tests/test_param_table.py fails when the document
and the model disagree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megascale.model.param_docs import render, replace_block

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def main() -> None:
    """Print the block, or replace it in the document with --write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the block in {DOC.name}")
    args = parser.parse_args()
    if args.write:
        DOC.write_text(replace_block(DOC.read_text()))
        print(f"updated {DOC}")
    else:
        print(render())


if __name__ == "__main__":
    main()
