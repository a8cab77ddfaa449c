"""What a retriever returns, checked at the boundary before anything else reads it.

A retriever is user code (a custom backend, a remote index, a plugin): the engine trusts none of
its output. ``check_results`` turns one ``search_batch`` return value into, per query, either a
clean ``HitList`` of fresh ``Hit`` objects or the reason that query got nothing:

- the call as a whole must return one list per query, else every query fails (``BadResults``);
- a query's entry must be a list (``HitList``, list or tuple) of hits, else that query fails;
- a hit must be a ``Hit`` or a mapping with its fields, with a non-empty ``str`` doc_id, a ``str``
  text, a finite real score and, if given, a ``str`` title, a ``dict`` metadata, a ``str`` source.
  A bad hit is dropped and counted (``info["dropped_hits"]``, first reason in
  ``info["dropped_reason"]``); the query keeps its good hits.
- texts and titles longer than the renderer could ever show are clipped (``info["clipped_texts"]``),
  so a 100 MB document costs the decode thread nothing;
- the list's ``info`` (the retriever's decisions) is kept only as JSON-safe data.

Copies, not references, go on: a retriever that later mutates the objects it returned cannot
change a trace.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

from .base import Hit, HitList

MAX_TEXT_CHARS = 65_536
"""A hit's text is clipped to this: more than any evidence budget shows (~4 chars a token)."""
MAX_TITLE_CHARS = 1_024


class BadResults(ValueError):
    """A ``search_batch`` return value that cannot be matched to its queries."""


def check_results(results: Any, num_queries: int) -> list[HitList | str]:
    """Per query, its checked hits or (a ``str``) why it has none; raises ``BadResults``."""
    if isinstance(results, (str, bytes, Mapping)) or not hasattr(results, "__len__"):
        raise BadResults(f"retriever returned {type(results).__name__}, not one list of hits per query")
    if len(results) != num_queries:
        raise BadResults(f"retriever returned {len(results)} result lists for {num_queries} queries")
    return [_check_list(r) for r in results]


def _check_list(hits: Any) -> HitList | str:
    if not isinstance(hits, (list, tuple)):
        return f"retriever returned {type(hits).__name__} for this query, not a list of hits"
    info = _json_safe(getattr(hits, "info", None))
    out, dropped, clipped, reason = [], 0, 0, None
    for raw in hits:
        try:
            hit, was_clipped = _check_hit(raw)
        except (TypeError, ValueError) as e:
            dropped += 1
            reason = reason or str(e)
            continue
        out.append(hit)
        clipped += was_clipped
    if dropped:
        info.update(dropped_hits=dropped, dropped_reason=reason)
    if clipped:
        info["clipped_texts"] = clipped
    return HitList(out, info)


def _check_hit(raw: Any) -> tuple[Hit, bool]:
    if isinstance(raw, Hit):
        fields = {name: getattr(raw, name, None) for name in Hit.__slots__}
    elif isinstance(raw, Mapping):
        fields = dict(raw)
    else:
        raise TypeError(f"a hit is a Hit or a mapping, got {type(raw).__name__}")
    doc_id, text, score = fields.get("doc_id"), fields.get("text"), fields.get("score")
    title, metadata, source = fields.get("title"), fields.get("metadata"), fields.get("source", "dense")
    if not isinstance(doc_id, str) or not doc_id:
        raise TypeError(f"doc_id must be a non-empty str, got {_show(doc_id)}")
    if not isinstance(text, str):
        raise TypeError(f"text of {doc_id!r} must be a str, got {_show(text)}")
    if isinstance(score, bool) or not isinstance(score, Real) or not math.isfinite(float(score)):
        raise ValueError(f"score of {doc_id!r} must be a finite number, got {_show(score)}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title of {doc_id!r} must be a str or None, got {_show(title)}")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata of {doc_id!r} must be a mapping, got {_show(metadata)}")
    if not isinstance(source, str):
        raise TypeError(f"source of {doc_id!r} must be a str, got {_show(source)}")
    clipped = len(text) > MAX_TEXT_CHARS or (title is not None and len(title) > MAX_TITLE_CHARS)
    return Hit(doc_id, text[:MAX_TEXT_CHARS], float(score), title[:MAX_TITLE_CHARS] if title else title,
               dict(metadata or {}), source), clipped


def _json_safe(info: Any) -> dict:
    """A copy of a hit list's ``info`` that ``json.dumps`` accepts (non-finite numbers as text)."""
    if not isinstance(info, Mapping):
        return {}
    try:
        return json.loads(json.dumps(dict(info), default=repr, allow_nan=True),
                          parse_constant=lambda c: c)  # NaN / Infinity stay readable, as strings
    except (TypeError, ValueError, RecursionError):
        return {"info_dropped": "the retriever's info was not JSON-serialisable"}


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
