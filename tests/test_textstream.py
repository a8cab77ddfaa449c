"""Streaming text: deltas never split a character, never show a marker, and add up to the answer."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rig_decode.engine.sequence import Sequence
from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab
from rig_decode.textstream import TextDeltas, complete_utf8

from .helpers import tiny_tokenizer

TOK = tiny_tokenizer()
VOCAB = MarkerVocab(TOK, MarkerSpec.special_token())
PIECES = ["Grüße", " 東京", " 🚀", " release 4.2.1", " and", "\n", "é", "👩‍👩‍👧", " <", "|", "retr"]


def test_complete_utf8_cuts_only_an_unfinished_character():
    text = "a東🚀".encode()
    assert complete_utf8(text) == text
    for cut in range(1, 4):  # inside the emoji (4 bytes)
        assert complete_utf8(text[: len(text) - cut]) == "a東".encode()
    assert complete_utf8("a東".encode()[:-1]) == b"a"
    assert complete_utf8(b"") == b""


def _stream(text: str, marker_at: int | None, query: str, stop=None, raw=False):
    """Feed ``text`` (with a marker inserted at ``marker_at``) token by token; return the deltas,
    the final visible text and the sequence."""
    if marker_at is not None:
        text = text[:marker_at] + VOCAB.spec.render(query) + text[marker_at:]
    ids = TOK.encode(text, add_special_tokens=False)
    seq = Sequence(1, [0], MarkerMatcher(VOCAB), 1000)
    deltas = TextDeltas(VOCAB, stop_ids=[2], raw=raw, stop=stop)
    out = []
    for t in ids:
        seq.append([t], sampled=True)
        seq.matcher.feed(t)
        out.append(deltas.feed([t], seq.matcher.visible_bytes(final=False)))
    out.append(deltas.feed([], seq.matcher.visible_bytes(final=True), final=True))
    return out, seq


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=12), st.integers(0, 40), st.booleans(),
       st.sampled_from(["error E1234", "東京 release"]))
def test_deltas_add_up_and_never_break_a_character(parts, at, with_marker, query):
    text = "".join(parts)
    out, seq = _stream(text, min(at, len(text)) if with_marker else None, query)
    assert "".join(out) == seq.matcher.visible_text().lstrip() == text.lstrip()
    assert all("\ufffd" not in d for d in out)


def test_a_marker_never_shows_even_in_part():
    out, _ = _stream("Looking it up. Release 4.2.1.", 15, "error E1234")
    seen = ""
    for d in out:
        seen += d
        assert "<" not in seen and "E1234" not in seen
    assert seen == "Looking it up. Release 4.2.1."


def test_stop_strings_are_cut_and_held_back():
    out, _ = _stream("Release 4.2.1 fixed it. Priya approved.", None, "", stop=["fixed", "zzz"])
    assert "".join(out) == "Release 4.2.1 "
    assert all("fix" not in d for d in out)


def test_the_answer_starts_at_its_first_word():
    """A marker adapter writes its answer after a space (and after a marker, the text resumes with
    one): the stream starts at the answer's first character, as ``Sequence.answer_text`` does."""
    out, _ = _stream(" Saibou", 0, "Tetrula Labs headquarters")
    assert "".join(out) == "Saibou" and out[0] == ""
    raw, _ = _stream(" Saibou", None, "", raw=True)
    assert "".join(raw) == " Saibou"


def test_raw_mode_shows_markers():
    out, _ = _stream("Answer: 東京", 8, "error E1234", raw=True)
    assert "".join(out) == "Answer: " + VOCAB.spec.render("error E1234") + "東京"
