"""A sequence's answer as text deltas, for streaming.

Tokens do not end on character boundaries (byte-level BPE splits a Chinese character or an
emoji across tokens) and a marker is only known to be a marker once its last byte arrives. So a
delta only ever covers text that can no longer change: complete UTF-8 characters, outside any
marker, and not the tail that could still begin one or complete a stop string. Concatenated, the
deltas are exactly the final text.
"""

from __future__ import annotations

from .markers import MarkerVocab


def complete_utf8(data: bytes) -> bytes:
    """``data`` without a trailing, still incomplete UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII): is its character complete?
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return data if back >= need else data[:-back]
    return data


class TextDeltas:
    """Hands out an answer's text as it becomes final, from the snapshots the engine's events carry.

    ``raw``: the whole completion as the model saw it (markers and evidence blocks included),
    instead of the answer with markers hidden and evidence left out; the answer starts at its
    first non-blank character (a marker adapter writes answers after a space, the way the names
    they copy appear in evidence). ``stop``: strings that end the answer (not included), as in
    OpenAI's API; ``stopped`` tells when one was found.
    """

    def __init__(self, vocab: MarkerVocab, stop_ids: list[int], raw: bool = False, stop: list[str] | None = None):
        self.vocab, self.stop_ids, self.raw = vocab, set(stop_ids), raw
        self.stop = [s for s in (stop or []) if s]
        self.stopped = False
        self.text = ""  # what was handed out so far
        self._raw = bytearray()

    def feed(self, token_ids: list[int], visible: bytes, final: bool = False) -> str:
        """The text that became final with this event: ``token_ids`` it added, ``visible`` the
        answer's visible bytes at that point (all of them when ``final``)."""
        if self.raw:
            for t in token_ids:
                if t not in self.stop_ids:  # the end-of-sequence token is not part of the answer
                    self._raw += self.vocab.token_bytes[t]
            data = bytes(self._raw)
        else:
            data = visible
        return self.delta(data, final)

    def delta(self, data: bytes, final: bool = False) -> str:
        """The text of ``data`` (the answer's bytes so far) not handed out yet and no longer able
        to change (all of it when ``final``)."""
        if self.stopped:
            return ""
        text = (data if final else complete_utf8(data)).decode("utf-8", "replace")
        if not self.raw:
            text = text.lstrip()
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                text, self.stopped = text[:at], True
        if not self.stopped and not final and self.stop:
            # hold back what could be the beginning of a stop string
            text = text[: max(len(self.text), len(text) - max(len(s) for s in self.stop) + 1)]
        if not text.startswith(self.text):  # cannot happen for well-formed streams; never resend
            return ""
        out, self.text = text[len(self.text):], text
        return out
