"""Find import cycles among the modules of a package tree (every import statement, at any depth, read
statically); prints each cycle and exits 1 if there is any. `tests/test_imports.py` runs it over server/ and
operator/."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_sites(root: Path) -> Iterator[tuple[str, str, Path, int]]:
    """(module, a module of the tree it imports, its file, the import's line), for every import statement at any
    depth. Importing a submodule runs its package's __init__ first, which is not a dependency on the package, so
    an import of a module's own parent package is left out."""
    mods = modules(root)
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for c in candidates:
                if c in mods and c != name and not name.startswith(c + "."):
                    yield name, c, path, node.lineno


def imports(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (import_sites)."""
    graph: dict[str, set[str]] = {name: set() for name in modules(root)}
    for name, target, _, _ in import_sites(root):
        graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def main() -> int:
    bad = False
    for root in sys.argv[1:] or ["server", "operator"]:
        for component in cycles(imports(Path(root))):
            print(f"import cycle in {root}/: {' <-> '.join(component)}")
            bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
