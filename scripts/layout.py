"""The package's layout, read from its sources: modules, their imports (lazy ones inside functions
included: they still tie two modules together), import cycles, who imports whom transitively,
and files over the line limit. ``tests/test_layout.py`` holds the repository to these rules and
``scripts/request_path.py`` uses the import graph to tell a call down a layer from one up.

    python scripts/layout.py          # the package's modules by layer, and any rule broken
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rig_decode"
PROGRAMS = (ROOT / "bench", ROOT / "scripts")
MAX_LINES = 400


def modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


def imports(name: str, path: Path, is_init: bool, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported module of the package, names taken from it) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: None if is_init else -1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in known:
                continue
            names = [a.name for a in node.names]
            found += [(f"{target}.{n}", []) for n in names if f"{target}.{n}" in known]
            found.append((target, [n for n in names if f"{target}.{n}" not in known]))
    return [(t, n) for t, n in found if t != name]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    mods = modules(package)
    return {name: {t for t, _ in imports(name, path, is_init, set(mods))} for name, (path, is_init) in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def long_files(folders, root: Path = ROOT) -> dict[str, int]:
    """The Python files under ``folders`` over ``MAX_LINES`` lines: path (from ``root``) -> lines."""
    return {str(p.relative_to(root)): n for folder in folders for p in sorted(folder.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}


def importers(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> every module that imports it, directly or through others (a caller above it)."""
    above: dict[str, set[str]] = {m: set() for m in graph}
    for m in graph:
        seen, todo = set(), list(graph[m])
        while todo:
            t = todo.pop()
            if t in seen or t not in graph:
                continue
            seen.add(t)
            todo += graph[t]
        for t in seen:
            above[t].add(m)
    return above


def private_imports() -> list[str]:
    """``importer: module.name`` for every private name a module imports from another."""
    mods = modules()
    return [f"{name}: {target}.{n}" for name, (path, is_init) in mods.items()
            for target, names in imports(name, path, is_init, set(mods))
            for n in names if n.startswith("_") and not n.startswith("__")]


def main() -> int:
    graph = import_graph()
    problems = {"import cycles": cycles(graph), "private imports": private_imports(),
                "files over the limit": long_files([PACKAGE, *PROGRAMS])}
    above = importers(graph)
    for m in sorted(graph, key=lambda m: (-len(above[m]), m)):
        print(f"{len(above[m]):4d} importers  {m}")
    for what, found in problems.items():
        print(f"{what}: {found or 'none'}")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
