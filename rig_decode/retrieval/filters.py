"""Metadata filters, so that superseded or out-of-scope documents are never returned.

    {"status": "active"}                      equality
    {"valid_until": {"gte": "today"}}         comparison; "today" is today's ISO date
    {"customer": {"in": ["Acme", "Orbital"]}} membership (also "nin", "ne", "gt", "lt", "lte")

A field no document has is an error (a typo would otherwise silently filter everything out). A
document without the field, or whose value cannot be compared, does not match.
"""

from __future__ import annotations

import datetime as _dt
import operator
from typing import Any, Callable

import numpy as np

from .base import RetrievalError

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "gte": operator.ge,
    "lt": operator.lt, "lte": operator.le,
    "in": lambda a, b: a in b, "nin": lambda a, b: a not in b,
}


def _resolve(value: Any) -> Any:
    return _dt.date.today().isoformat() if value == "today" else value


def compile_filter(filters: dict[str, Any] | None, known_fields: set[str]) -> Callable[[dict], bool] | None:
    if not filters:
        return None
    if not isinstance(filters, dict):
        raise RetrievalError(f"filters must be a mapping of field -> condition, got {type(filters).__name__}")
    checks: list[tuple[str, Callable, Any]] = []
    for field, cond in filters.items():
        if field not in known_fields:
            known = ", ".join(sorted(known_fields)) or "none"
            raise RetrievalError(f"unknown filter field {field!r} (documents have: {known})")
        conds = cond if isinstance(cond, dict) else {"eq": cond}
        for op, value in conds.items():
            if op not in _OPS:
                raise RetrievalError(f"unknown filter operator {op!r} for field {field!r} "
                                     f"(use one of {', '.join(_OPS)})")
            if op in ("in", "nin") and not isinstance(value, (list, tuple, set)):
                raise RetrievalError(f"filter {field}.{op} needs a list")
            checks.append((field, _OPS[op], _resolve(value)))

    def match(meta: dict) -> bool:
        for field, fn, value in checks:
            if field not in meta:
                return False
            try:
                if not fn(meta[field], value):
                    return False
            except TypeError:
                return False
        return True

    return match


def filter_mask(filters: dict[str, Any] | None, metadatas: list[dict], known_fields: set[str]) -> np.ndarray | None:
    """Boolean mask over documents, or None when there is nothing to filter."""
    match = compile_filter(filters, known_fields)
    if match is None:
        return None
    return np.fromiter((match(m) for m in metadatas), dtype=bool, count=len(metadatas))
