"""`megascale bench <name>`: each benchmark is a module here exposing main(argv) -> int."""

from __future__ import annotations

import importlib
import pkgutil
import sys

from megascale.errors import UserError


def available() -> list[str]:
    """Names of the benchmark modules shipped in this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    """Dispatch `megascale bench NAME [args]` to megascale.bench.NAME.main(args)."""
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: megascale bench {" + ",".join(names) + "} [args]")
        return 0
    if argv[0] not in names:
        raise UserError(f"unknown benchmark '{argv[0]}'; choose one of: {', '.join(names)}")
    module = importlib.import_module(f"megascale.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
