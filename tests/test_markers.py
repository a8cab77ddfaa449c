"""Marker detection on the token stream, however the tokenizer splits it."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab, token_bytes_table

from .helpers import tiny_tokenizer

TOK = tiny_tokenizer()
TOK_SPECIAL = tiny_tokenizer(special_markers=True)
VOCABS = {
    (style, special): MarkerVocab(TOK_SPECIAL if special else TOK, MarkerSpec.from_style(style))
    for style in ("special_token", "json") for special in (False, True)
}

text = st.text(alphabet=st.sampled_from(list("abc xyz.,;:-Grüße東京🚀0123456789\n")), max_size=30)
query = st.text(alphabet=st.sampled_from(list("abcdefgh E1234.-ü東")), min_size=1, max_size=25).filter(str.strip)


def split_encode(tokenizer, s: str, cuts: list[int]) -> list[int]:
    """Encode ``s`` as separately tokenised pieces cut at the given character positions: every
    such cut gives a different token sequence that still spells the same text."""
    points = sorted({c % (len(s) + 1) for c in cuts} | {0, len(s)})
    ids = []
    for a, b in zip(points, points[1:]):
        ids += tokenizer.encode(s[a:b], add_special_tokens=False)
    return ids


def feed_all(vocab, ids):
    m = MarkerMatcher(vocab)
    events = [e for t in ids for e in m.feed(t)]
    return m, events


def test_token_bytes_roundtrip():
    table = token_bytes_table(TOK)
    s = "Grüße aus Köln — 東京 🚀 <|retrieve|>x<|endofretrieve|>"
    ids = TOK.encode(s, add_special_tokens=False)
    assert b"".join(table[i] for i in ids).decode() == TOK.decode(ids) == s


def test_vocabs_over_one_tokenizer_share_its_table_until_it_grows():
    """Engines over one tokenizer scan its vocabulary once; a token added later is seen."""
    tok = tiny_tokenizer()
    a, b = MarkerVocab(tok, MarkerSpec.special_token()), MarkerVocab(tok, MarkerSpec.json())
    assert a.token_bytes is b.token_bytes and a.newline_ids is b.newline_ids
    assert a.start_completing_ids((0,)) is MarkerVocab(tok, MarkerSpec.special_token()).start_completing_ids((0,))
    near_a, near_b = (a.start[0].m - 1,), tuple(d.m - 1 for d in b.start)  # one byte left to write
    assert set(a.start_completing_ids(near_a).tolist()) != set(b.start_completing_ids(near_b).tolist())
    before = len(tok)
    tok.add_tokens(["<zz\nzz>"])
    grown = MarkerVocab(tok, MarkerSpec.special_token())
    assert len(grown) == before + 1 and grown.token_bytes[before] == b"<zz\nzz>"
    assert before in grown.newline_ids.tolist() and before not in a.newline_ids.tolist()


def test_special_tokens_are_single_ids_with_their_text():
    ids = TOK_SPECIAL.encode("<|retrieve|>", add_special_tokens=False)
    assert len(ids) == 1
    assert token_bytes_table(TOK_SPECIAL)[ids[0]] == b"<|retrieve|>"
    assert len(TOK.encode("<|retrieve|>", add_special_tokens=False)) > 1


@pytest.mark.parametrize("style", ["special_token", "json"])
@pytest.mark.parametrize("special", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=text, q=query, after=text, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_every_split_is_detected(style, special, before, q, after, cuts):
    vocab = VOCABS[(style, special)]
    s = before + vocab.spec.render(q) + after
    ids = split_encode(vocab.tokenizer, s, cuts)
    m, events = feed_all(vocab, ids)
    markers = [e for e in events if e.kind == "marker"]
    assert len(markers) == 1, (s, events)
    assert markers[0].query == q.strip()
    assert m.num_markers == 1 and not m.is_open
    assert m.visible_text() == before + after


def test_marker_at_first_and_last_token():
    vocab = VOCABS[("special_token", True)]
    ids = vocab.marker_token_ids("E1234")
    m, events = feed_all(vocab, ids)
    assert [e.kind for e in events] == ["marker"] and events[0].start == 0
    assert events[0].end == len(m.stream)
    assert m.num_marker_tokens() == len(ids)


def test_two_markers_and_json_whitespace_variants():
    vocab = VOCABS[("json", False)]
    s = 'a {"retrieve":"first"} b { "retrieve": "second" } c'
    _, events = feed_all(vocab, TOK.encode(s))
    assert [e.query for e in events if e.kind == "marker"] == ["first", "second"]


def test_json_query_unescapes():
    vocab = VOCABS[("json", False)]
    _, events = feed_all(vocab, TOK.encode(vocab.spec.render('say "hi"')))
    assert events[-1].query == 'say "hi"'


def test_nested_marker_is_an_error_and_the_query_restarts():
    vocab = VOCABS[("special_token", False)]
    m, events = feed_all(vocab, TOK.encode("x <|retrieve|>abc <|retrieve|>real query<|endofretrieve|> y"))
    assert [e.kind for e in events] == ["error", "marker"]
    assert "nested" in events[0].error
    assert events[1].query == "real query"
    assert m.visible_text() == "x  y"


def test_stray_end_marker_is_an_error_without_a_hop():
    vocab = VOCABS[("special_token", False)]
    m, events = feed_all(vocab, TOK.encode("done<|endofretrieve|>"))
    assert [e.kind for e in events] == ["error"] and m.num_markers == 0


def test_empty_query_is_flagged():
    vocab = VOCABS[("special_token", False)]
    _, events = feed_all(vocab, TOK.encode("<|retrieve|>  <|endofretrieve|>"))
    assert events[0].kind == "marker" and events[0].error == "empty query"


def test_unterminated_marker_stays_open_and_hidden():
    vocab = VOCABS[("special_token", False)]
    m, events = feed_all(vocab, TOK.encode("answer <|retrieve|>never closed"))
    assert events == [] and m.is_open and m.visible_text() == "answer "


@pytest.mark.parametrize("style", ["special_token", "json"])
@pytest.mark.parametrize("special", [False, True])
def test_forced_end_tokens_close_the_query_from_any_state(style, special):
    vocab = VOCABS[(style, special)]
    end = vocab.spec.end[0]
    for k in range(len(end)):
        # The model wrote the first k bytes of the end delimiter itself; forcing completes it.
        m, _ = feed_all(vocab, vocab.tokenizer.encode(vocab.spec.start[0] + "q" + end[:k], add_special_tokens=False))
        events, steps = [], 0
        while m.is_open:
            events += m.feed(m.next_forced_end())
            steps += 1
            assert steps <= len(end)
        assert events[-1].kind == "marker"


@pytest.mark.parametrize("style", ["special_token", "json"])
def test_start_completing_ids_are_exactly_the_completing_tokens(style):
    vocab = VOCABS[(style, False)]
    start = vocab.spec.start[0]
    for k in (0, 1, len(start) - 1):
        m, _ = feed_all(vocab, TOK.encode(start[:k]) if k else [])
        banned = set(vocab.start_completing_ids(m.start_states).tolist())
        for t in range(len(vocab)):
            probe = MarkerMatcher(vocab)
            for u in (TOK.encode(start[:k]) if k else []):
                probe.feed(u)
            completes = any(e.kind == "marker" for e in probe.feed(t)) or probe.is_open
            assert (t in banned) == completes, (k, t, vocab.token_bytes[t])
