"""The package's layout: one concept per file (none over 400 lines, and none of bench/ and scripts/
either), no import cycle between its modules, and no module importing another's private names.
Imports inside functions count: a lazy import still ties two modules together."""

from __future__ import annotations

from .helpers import load_script

layout = load_script("scripts/layout.py")
PACKAGE, PROGRAMS, MAX_LINES = layout.PACKAGE, layout.PROGRAMS, layout.MAX_LINES
cycles, import_graph, long_files = layout.cycles, layout.import_graph, layout.long_files


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
    private = layout.private_imports()
    assert not private, private
