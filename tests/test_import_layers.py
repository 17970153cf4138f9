"""Imports flow one way: lower layers never import higher ones, and no import cycle crosses packages.

A static check over the source (ast, no imports executed), so it is fast and sees function-level
imports as well. Every module belongs to the layer of its longest listed prefix; a module may import
its own layer and the layers below it. Imports under `if TYPE_CHECKING:` are annotations only and
are left out.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "megascale"

# Lowest first. "model facts" (the FLOPs count) sit just above the config, so the pipeline partition
# and the run plan can weigh stages without reaching up into the model or the planner.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("megascale.errors", "megascale.seeds", "megascale.timers"),
    ("megascale.config", "megascale.config_fault", "megascale.config_fields", "megascale.config_moe", "megascale.precision",
     "megascale.layout_rules"),
    ("megascale.model.flops",),
    ("megascale.kernels", "megascale.optim"),
    ("megascale.distributed",),
    ("megascale.run_plan",),
    ("megascale.model",),
    ("megascale.data",),
    ("megascale.checkpoint",),
    ("megascale.generate",),
    ("megascale.perf",),
    ("megascale.training", "megascale.diagnostics", "megascale.report"),
    ("megascale.bench",),
    ("megascale.train", "megascale.doctor", "megascale.show_config", "megascale.cli", "megascale.__main__",
     "megascale"),
)


def module_name(path: Path) -> str:
    """Dotted module name of a file under ROOT."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix that names `module` (or a package holding it)."""
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported megascale module, line) for every runtime import in a file, at any depth."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            for alias in node.names:
                target = f"{base}.{alias.name}"
                is_module = (ROOT.parent / target.replace(".", "/")).with_suffix(".py").is_file() or \
                    (ROOT.parent / target.replace(".", "/") / "__init__.py").is_file()
                found.append((target if is_module else base, node.lineno))
    return [(name, line) for name, line in found if name == "megascale" or name.startswith("megascale.")]


@functools.cache  # both tests read the same parse
def all_imports() -> dict[str, list[tuple[str, int]]]:
    """Module -> its megascale imports, for every module in the package."""
    return {module_name(path): imports_of(path) for path in sorted(ROOT.rglob("*.py"))}


def unit_of(module: str) -> str:
    """The unit cycles are checked between: the longest LAYERS prefix naming the module (a package,
    a top-level module, or a light module such as megascale.model.flops that is its own unit)."""
    prefixes = [prefix for layer in LAYERS for prefix in layer
                if module == prefix or module.startswith(prefix + ".")]
    return max(prefixes, key=len)


def test_lower_layers_never_import_higher_ones() -> None:
    upward = [f"{module}:{line} imports {target} (layer {layer_of(target)} > {layer_of(module)})"
              for module, targets in all_imports().items() for target, line in targets
              if layer_of(target) > layer_of(module)]
    assert not upward, "imports that reach up a layer:\n" + "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycle_across_packages() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in all_imports().items():
        graph[unit_of(module)]
        for target, _ in targets:
            if unit_of(target) != unit_of(module):
                graph[unit_of(module)].add(unit_of(target))
    assert not _cycle(graph), "import cycle between packages: " + " -> ".join(_cycle(graph))
