"""The package's layout: one concept per file (none over 400 lines, and none of bench/ and scripts/
either), no import cycle between its modules, and no module importing another's private names.
Imports inside functions count: a lazy import still ties two modules together."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rig_decode"
PROGRAMS = (ROOT / "bench", ROOT / "scripts")
MAX_LINES = 400


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
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


def import_graph() -> dict[str, set[str]]:
    mods = modules()
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


def test_no_file_of_the_package_is_over_400_lines():
    long = long_files([PACKAGE])
    assert not long, f"split these by concept: {long}"


def test_no_benchmark_or_script_is_over_400_lines():
    assert all(folder.is_dir() for folder in PROGRAMS)
    long = long_files(PROGRAMS)
    assert not long, f"split these by concept: {long}"


def test_the_line_check_finds_a_long_file(tmp_path):
    folder = tmp_path / "bench"
    (folder / "deep").mkdir(parents=True)
    (folder / "short.py").write_text("x = 1\n" * MAX_LINES)
    (folder / "deep" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (folder / "notes.txt").write_text("x\n" * (MAX_LINES + 1))
    assert long_files([folder], tmp_path) == {"bench/deep/long.py": MAX_LINES + 1}


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_modules_private_names():
    mods = modules()
    private = [f"{name}: {target}.{n}" for name, (path, is_init) in mods.items()
               for target, names in imports(name, path, is_init, set(mods))
               for n in names if n.startswith("_") and not n.startswith("__")]
    assert not private, private
