"""Retrieve markers, detected incrementally on the token stream.

A marker is text: ``<|retrieve|>query<|endofretrieve|>`` or ``{"retrieve": "query"}``. A model may
write it as one added special token per delimiter, or as any sequence of ordinary tokens whose bytes
spell it (``<|``, ``ret``, ``rieve``, ``|>`` …), and different samples split it differently. So the
matcher works on bytes, not token ids: every token id maps to the bytes it decodes to (a table built
once per tokenizer), and each delimiter is recognised by a small DFA (KMP automaton) fed those bytes.
An added special token whose content is ``<|retrieve|>`` is therefore just a token with those bytes.

State machine per sequence::

    OUTSIDE --start delimiter--> IN_QUERY --end delimiter--> OUTSIDE (+1 marker, query extracted)
                                  IN_QUERY --start delimiter--> IN_QUERY (nested: error, query restarts)

The same tables answer the two questions logits processors ask each step: which token ids would
complete a start delimiter from the current state (banned once the hop budget is spent), and which
token to force to close an over-long query.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

import torch

__all__ = ["MarkerSpec", "MarkerVocab", "MarkerMatcher", "MarkerEvent", "token_bytes_table"]


@dataclass(frozen=True, slots=True)
class MarkerSpec:
    style: str
    start: tuple[str, ...]
    """Accepted spellings of the start delimiter; the first is canonical (used in prompts)."""
    end: tuple[str, ...]
    """Accepted spellings of the end delimiter; the first is the one forced at the query cap."""
    flag_stray_end: bool
    """Report an end delimiter seen outside a query (off where it is ordinary text, as in JSON)."""

    @classmethod
    def special_token(cls) -> "MarkerSpec":
        return cls("special_token", ("<|retrieve|>",), ("<|endofretrieve|>",), flag_stray_end=True)

    @classmethod
    def json(cls) -> "MarkerSpec":
        return cls(
            "json",
            ('{"retrieve": "', '{"retrieve":"', '{ "retrieve": "'),
            ('"}', '" }'),
            flag_stray_end=False,
        )

    @classmethod
    def from_style(cls, style: str) -> "MarkerSpec":
        if style == "special_token":
            return cls.special_token()
        if style == "json":
            return cls.json()
        raise ValueError(f"unknown marker style {style!r} (expected 'special_token' or 'json')")

    def render(self, query: str) -> str:
        """The canonical text of a marker carrying ``query``."""
        body = json.dumps(query)[1:-1] if self.style == "json" else query
        return f"{self.start[0]}{body}{self.end[0]}"

    def decode_query(self, raw: str) -> str:
        raw = raw.strip()
        if self.style == "json":
            try:
                return json.loads(f'"{raw}"').strip()
            except json.JSONDecodeError:
                return raw
        return raw


# --------------------------------------------------------------------------------------------------
# token id -> bytes


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte<->unicode map, inverted (used by every byte-level BPE tokenizer)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kinds(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    spec = json.loads(backend.to_str()).get("decoder") or {}
    kinds, stack = set(), [spec]
    while stack:
        d = stack.pop()
        kinds.add(d.get("type", ""))
        stack.extend(d.get("decoders") or [])
    return kinds


def token_bytes_table(tokenizer) -> list[bytes]:
    """The bytes each token id contributes to decoded text, for every id the tokenizer knows."""
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    added = {i for i in getattr(tokenizer, "added_tokens_decoder", {})}
    kinds = _decoder_kinds(tokenizer)
    table: list[bytes] = []
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()
        for i, piece in enumerate(pieces):
            if piece is None:
                table.append(b"")
            elif i in added or any(ch not in alphabet for ch in piece):
                table.append(piece.encode("utf-8"))
            else:
                table.append(bytes(alphabet[ch] for ch in piece))
    elif "Metaspace" in kinds or "ByteFallback" in kinds or "Replace" in kinds:
        for i, piece in enumerate(pieces):
            if piece is None:
                table.append(b"")
            elif i not in added and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table.append(bytes([int(piece[3:5], 16)]))
            else:
                table.append(piece.replace("\u2581", " ").encode("utf-8"))
    else:  # a tokenizer we cannot introspect: decode ids one by one
        table = [tokenizer.decode([i]).encode("utf-8") for i in range(n)]
    return table


# --------------------------------------------------------------------------------------------------
# byte DFAs


class _Dfa:
    """KMP automaton for one literal byte pattern: ``step[state][byte] -> state``; state m = match."""

    __slots__ = ("pattern", "m", "step")

    def __init__(self, pattern: bytes):
        self.pattern, self.m = pattern, len(pattern)
        fail = [0] * self.m
        k = 0
        for i in range(1, self.m):
            while k and pattern[i] != pattern[k]:
                k = fail[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            fail[i] = k
        self.step = []
        for s in range(self.m):
            row = [0] * 256 if s == 0 else list(self.step[fail[s - 1]])
            row[pattern[s]] = s + 1
            self.step.append(row)


class _TokenTable:
    """A tokenizer's ``token_bytes_table`` and the id sets scanned from it, built once per tokenizer
    (a scan of the whole vocabulary takes a noticeable fraction of a second): every engine, session
    and test over one tokenizer shares them."""

    def __init__(self, tokenizer):
        self.token_bytes: tuple[bytes, ...] = tuple(token_bytes_table(tokenizer))
        self._scans: dict[tuple, torch.Tensor] = {}

    def scan(self, key: tuple, keep) -> torch.Tensor:
        """The ids whose bytes ``keep(b)`` accepts, remembered under ``key`` (it names ``keep``)."""
        hit = self._scans.get(key)
        if hit is None:
            hit = self._scans[key] = torch.tensor([t for t, b in enumerate(self.token_bytes) if keep(b)],
                                                  dtype=torch.long)
        return hit


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _token_table(tokenizer) -> _TokenTable:
    """The shared table of this tokenizer (rebuilt if tokens were added since)."""
    with _TABLES_LOCK:
        try:
            table = _TABLES.get(tokenizer)
        except TypeError:  # a tokenizer that cannot be weakly referenced: its own table
            return _TokenTable(tokenizer)
        if table is None or len(table.token_bytes) != len(tokenizer):
            table = _TABLES[tokenizer] = _TokenTable(tokenizer)
        return table


class MarkerVocab:
    """Everything about a (tokenizer, marker spec) pair that is computed once and shared by rows."""

    def __init__(self, tokenizer, spec: MarkerSpec):
        self.tokenizer, self.spec = tokenizer, spec
        self._table = _token_table(tokenizer)
        self.token_bytes = self._table.token_bytes
        self.start = [_Dfa(s.encode()) for s in spec.start]
        self.end = [_Dfa(e.encode()) for e in spec.end]

    def __len__(self) -> int:
        return len(self.token_bytes)

    def start_completing_ids(self, states: tuple[int, ...]) -> torch.Tensor:
        """Token ids that, fed from these start-DFA states, would complete a start delimiter."""
        needles = tuple((d.pattern, d.pattern[:s]) for d, s in zip(self.start, states))
        return self._table.scan(("completes", needles),
                                lambda b: b and any(p in pre + b for p, pre in needles))

    @property
    def commit_len(self) -> int:
        """Once this many bytes of the end delimiter are written inside a query, the rest is forced."""
        return min(2, self.end[0].m - 1)

    @cached_property
    def whole_end_ids(self) -> torch.Tensor:
        """Tokens that spell a whole end delimiter by themselves (an added ``<|endofretrieve|>``)."""
        ends = frozenset(d.pattern for d in self.end)
        return self._table.scan(("spells", ends), lambda b: b in ends)

    @cached_property
    def newline_ids(self) -> torch.Tensor:
        return self._table.scan(("newline",), lambda b: b"\n" in b)

    @cached_property
    def forced_end(self) -> list[int]:
        """For each state of the canonical end DFA, the token that continues the end delimiter."""
        pattern = self.end[0].pattern
        out = []
        for s in range(len(pattern)):
            rest = pattern[s:]
            ids = self.tokenizer.encode(rest.decode("utf-8", "ignore"), add_special_tokens=False)
            if ids and self.token_bytes[ids[0]] and rest.startswith(self.token_bytes[ids[0]]):
                out.append(ids[0])
                continue
            best = max(
                (t for t, b in enumerate(self.token_bytes) if b and rest.startswith(b)),
                key=lambda t: len(self.token_bytes[t]),
                default=None,
            )
            if best is None:
                raise ValueError(f"no token of this tokenizer spells the start of {rest!r}")
            out.append(best)
        return out

    def marker_token_ids(self, query: str) -> list[int]:
        """How the tokenizer would write a complete marker (used by tests and training data)."""
        return self.tokenizer.encode(self.spec.render(query), add_special_tokens=False)


# --------------------------------------------------------------------------------------------------
# per-sequence matcher


class Phase(Enum):
    OUTSIDE = 0
    IN_QUERY = 1


@dataclass(slots=True)
class MarkerEvent:
    kind: str
    """``marker`` (a complete marker: retrieve now) or ``error`` (garbled input, no retrieval)."""
    query: str = ""
    start: int = 0
    end: int = 0
    error: str | None = None


@dataclass(slots=True)
class MarkerMatcher:
    vocab: MarkerVocab
    phase: Phase = Phase.OUTSIDE
    num_markers: int = 0
    query_num_tokens: int = 0
    stream: bytearray = field(default_factory=bytearray)
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Byte spans of ``stream`` that belong to markers (hidden from the answer text)."""
    token_ends: list[int] = field(default_factory=list)
    """``stream`` offset after each token fed."""
    _start_states: list[int] = field(default_factory=list)
    _end_states: list[int] = field(default_factory=list)
    _open_at: int = 0
    _query_from: int = 0

    def __post_init__(self):
        self._start_states = [0] * len(self.vocab.start)
        self._end_states = [0] * len(self.vocab.end)

    @property
    def is_open(self) -> bool:
        return self.phase is Phase.IN_QUERY

    @property
    def start_states(self) -> tuple[int, ...]:
        return tuple(self._start_states)

    def must_close(self, max_query_tokens: int) -> bool:
        """The query is at its token cap, or its end delimiter has begun: force the rest of it."""
        return self.phase is Phase.IN_QUERY and (
            self.query_num_tokens >= max_query_tokens or self._end_states[0] >= self.vocab.commit_len
        )

    def next_forced_end(self) -> int:
        return self.vocab.forced_end[self._end_states[0]]

    def feed(self, token_id: int) -> list[MarkerEvent]:
        events: list[MarkerEvent] = []
        if self.phase is Phase.IN_QUERY:
            self.query_num_tokens += 1
        for byte in self.vocab.token_bytes[token_id]:
            self.stream.append(byte)
            pos = len(self.stream)
            started = self._advance(self.vocab.start, self._start_states, byte)
            ended = self._advance(self.vocab.end, self._end_states, byte)
            if started is not None:
                if self.phase is Phase.IN_QUERY:
                    events.append(MarkerEvent("error", start=self._open_at, end=pos,
                                              error="nested retrieve marker: the open query was dropped"))
                    self.spans.append((self._open_at, pos - started))
                if self.phase is Phase.OUTSIDE:  # a nested start keeps counting toward the query cap
                    self.query_num_tokens = 0
                self.phase, self._open_at, self._query_from = Phase.IN_QUERY, pos - started, pos
                self._end_states = [0] * len(self._end_states)
            elif ended is not None:
                if self.phase is Phase.IN_QUERY:
                    raw = bytes(self.stream[self._query_from : pos - ended]).decode("utf-8", "replace")
                    query = self.vocab.spec.decode_query(raw)
                    self.spans.append((self._open_at, pos))
                    self.phase = Phase.OUTSIDE
                    self.num_markers += 1
                    events.append(MarkerEvent("marker", query=query, start=self._open_at, end=pos,
                                              error=None if query else "empty query"))
                elif self.vocab.spec.flag_stray_end:
                    self.spans.append((pos - ended, pos))
                    events.append(MarkerEvent("error", start=pos - ended, end=pos,
                                              error="end marker without a start marker"))
        self.token_ends.append(len(self.stream))
        return events

    def num_marker_tokens(self) -> int:
        """Tokens fed so far that carry at least one byte of a marker."""
        spans = self.spans + ([(self._open_at, len(self.stream))] if self.is_open else [])
        count, begin = 0, 0
        for end in self.token_ends:
            if end > begin and any(a < end and begin < b for a, b in spans):
                count += 1
            begin = end
        return count

    @staticmethod
    def _advance(dfas: list[_Dfa], states: list[int], byte: int) -> int | None:
        """Advance every spelling's DFA; on a match reset all and return the matched length."""
        for i, dfa in enumerate(dfas):
            states[i] = dfa.step[states[i]][byte]
            if states[i] == dfa.m:
                states[:] = [0] * len(states)
                return dfa.m
        return None

    def visible_bytes(self, final: bool = True) -> bytes:
        """The generated bytes with every marker span removed (an open marker is hidden too).

        Unless ``final``, the tail that may still become a marker (bytes matching the beginning of
        a start delimiter, or of an end delimiter where stray ends are flagged) is held back, so a
        stream of these never shows text that a later token turns into a marker."""
        spans = list(self.spans)
        end = len(self.stream)
        if self.phase is Phase.IN_QUERY:
            spans.append((self._open_at, end))
        elif not final:
            hold = max(self._start_states, default=0)
            if self.vocab.spec.flag_stray_end:
                hold = max(hold, *self._end_states)
            end -= hold
        out, prev = bytearray(), 0
        for a, b in sorted(spans):
            if a > prev:
                out += self.stream[prev:min(a, end)]
            prev = max(prev, b)
        if prev < end:
            out += self.stream[prev:end]
        return bytes(out)

    def visible_text(self) -> str:
        """The generated text with every marker span removed (an open marker is hidden too)."""
        return self.visible_bytes().decode("utf-8", "replace")
