"""bench/harness.py: the table every benchmark prints and the JSON line it prints last."""

import io
import json

from .helpers import load_script

harness = load_script("bench/harness.py")


def _printed(fn, *args, **kwargs) -> list[str]:
    out = io.StringIO()
    fn(*args, **kwargs, out=out)
    return out.getvalue().splitlines()


def test_columns_fit_their_widest_cell_and_a_note_runs_on():
    table = harness.Table(("name", "<"), ("ms", "{:.1f}"), ("ratio", "{:.2f}x"), "syncs")
    table.add("splice", 1234.56, 3.14159, None)
    table.add("hop", 5.0, 1.0, 2)
    table.add("rerank", "n/a (no model on disk: a reason longer than any column)")
    assert _printed(table.print) == [
        "name        ms  ratio  syncs",
        "splice  1234.6  3.14x      -",
        "hop        5.0  1.00x      2",
        "rerank  n/a (no model on disk: a reason longer than any column)",
    ]


def test_markdown_and_a_format_function():
    table = harness.Table(("rule", "<"), ("share", "{:.0%}"), ("flag", lambda v: "yes" if v else "no"), markdown=True)
    table.add("tail", 0.25, True)
    assert _printed(table.print) == ["| rule | share | flag |", "|---|---:|---:|", "| tail | 25% | yes |"]


def test_fields_and_the_json_line():
    assert _printed(harness.fields, {"completed": 2, "hops": {0: 1}}) == ["  completed: 2", "       hops: {0: 1}"]
    record = {"bench": "x", "ms": 1.234567, "rows": [{"ok": True, "n": 3, "v": 0.1 + 0.2}], "na": None}
    assert json.loads(_printed(harness.emit, record)[0]) == record
    assert json.loads(_printed(harness.emit, record, digits=2)[0]) == {**record, "ms": 1.23,
                                                                       "rows": [{"ok": True, "n": 3, "v": 0.3}]}
