"""What every benchmark prints: a readable table (or ``key: value`` lines), then its result as ONE
JSON line last, also when ``timeout`` stops it (``stop_on_sigterm``). Standard library only
(timing.py holds the torch side): bench/ingest.py's index load time includes importing torch."""

from __future__ import annotations

import json
import signal
import threading


class Table:
    """A header and one line per row, each column as wide as its header or its widest cell.

    A column is ``header`` or ``(header, fmt)``: ``fmt`` formats a value, as a format string
    (``"{:.1f}"``, ``"{:.2f}x"``; the default ``"{}"``) or a function; ``None`` shows as ``-``.
    Columns are right-aligned; a format string starting with ``<`` left-aligns its column (``"<"``
    alone: the default format). A row shorter than the header ends in a note (an error, a reason)
    that runs on past its column, unpadded. ``markdown=True``: a Markdown table, cells unpadded.
    """

    def __init__(self, *columns, markdown: bool = False):
        specs = [(c, "{}") if isinstance(c, str) else c for c in columns]
        self.headers = [header for header, _ in specs]
        self.left = [isinstance(fmt, str) and fmt.startswith("<") for _, fmt in specs]
        self.formats = [(fmt[1:] or "{}") if left else fmt for (_, fmt), left in zip(specs, self.left)]
        self.markdown = markdown
        self.rows: list[list[str]] = []

    def add(self, *values) -> None:
        """One row; given fewer values than columns, the last is a note, shown as it is."""
        n = len(values) if len(values) == len(self.formats) else len(values) - 1
        self.rows.append([_cell(f, v) for f, v in zip(self.formats, values[:n])] + [str(v) for v in values[n:]])

    def lines(self) -> list[str]:
        if self.markdown:
            rule = "|" + "".join("---|" if left else "---:|" for left in self.left)
            return [_markdown(self.headers), rule, *(_markdown(r) for r in self.rows)]
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            full = row if len(row) == len(widths) else row[:-1]  # a note does not widen its column
            widths = [max(w, len(c)) for w, c in zip(widths, full)] + widths[len(full):]

        def line(cells):
            padded = [c.ljust(w) if left else c.rjust(w) for c, w, left in zip(cells, widths, self.left)]
            if len(cells) < len(widths):
                padded[-1] = cells[-1]
            return "  ".join(padded).rstrip()

        return [line(self.headers), *(line(r) for r in self.rows)]

    def print(self, out=None) -> None:
        print("\n".join(self.lines()), file=out)


def _cell(fmt, value) -> str:
    if value is None:
        return "-"
    return fmt(value) if callable(fmt) else fmt.format(value)


def _markdown(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def fields(values: dict, out=None) -> None:
    """``key: value`` lines, indented, the keys right-aligned."""
    width = max(map(len, values), default=0)
    for k, v in values.items():
        print(f"  {k:>{width}}: {v}", file=out)


def emit(record: dict, digits: int | None = None, out=None) -> None:
    """The benchmark's result: one JSON line, the last line it prints; with ``digits``, every float
    in it rounded to as many decimals."""
    if digits is not None:
        record = json.loads(json.dumps(record), parse_float=lambda f: round(float(f), digits))
    print(json.dumps(record), file=out, flush=True)


class Stopped(BaseException):
    """SIGTERM arrived: a BaseException, so no error handling of a benchmark takes it for its own failure."""


SIGTERM_SEEN = threading.Event()  # also set: an exception raised in a finalizer is printed and dropped


def stop_on_sigterm():
    """Raise ``Stopped`` on SIGTERM from now on; returns the handler it replaced."""
    SIGTERM_SEEN.clear()  # a run started in the same process after a stopped one is not stopped at once

    def stop(signum, frame):
        SIGTERM_SEEN.set()
        raise Stopped()

    return signal.signal(signal.SIGTERM, stop)
