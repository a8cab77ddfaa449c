import pytest

from rig_decode.evidence import NO_EVIDENCE, EvidenceFormatter
from rig_decode.retrieval.base import Hit

HITS = [Hit(f"d{i}", "word " * (10 * i + 5), 1.0, title=f"T{i}") for i in range(1, 5)]


def test_block_fits_budget_and_is_deterministic(tok):
    f = EvidenceFormatter(tok, budget=60)
    a, b = f.render_block(HITS, 1), f.render_block(HITS, 1)
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 60
    assert a.truncated and a.doc_ids[0] == "d1"
    assert tok.decode(a.token_ids).startswith("\n<evidence>\n[1] T1: word")
    assert tok.decode(a.token_ids).endswith("</evidence>\n")


def test_everything_fits_when_budget_allows(tok):
    block = EvidenceFormatter(tok, budget=2000).render_block(HITS, 1)
    assert block.doc_ids == ["d1", "d2", "d3", "d4"] and not block.truncated
    assert tok.decode(block.token_ids) == block.text


def test_no_hits_gives_a_no_evidence_block(tok):
    block = EvidenceFormatter(tok).render_block([], 2)
    assert NO_EVIDENCE in tok.decode(block.token_ids) and block.doc_ids == []


def test_budget_too_small(tok):
    with pytest.raises(ValueError, match="cannot hold even an empty evidence block"):
        EvidenceFormatter(tok, budget=3)
    with pytest.raises(ValueError):
        EvidenceFormatter(tok, budget=100).render_block(HITS, 1, budget=2)


def _pieces(block):
    out, at = [], 0
    for n in block.segments:
        out.append(block.token_ids[at : at + n])
        at += n
    assert at == len(block.token_ids)
    return out


def test_a_documents_text_is_one_piece_under_any_number(tok):
    """Each document is two pieces, its number and its text, so zero-prefill's store reuses the
    text's KV whatever number the document gets; the block's tokens are the whole lines' tokens."""
    f = EvidenceFormatter(tok, budget=2000)
    first = _pieces(f.render_block(HITS[:2], 1))
    later = _pieces(f.render_block(HITS[:2], 2, numbers=[7, 12]))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert [tok.decode(p) for p in first[1:3]] == ["[1]", " T1: " + " ".join(HITS[0].text.split()) + "\n"]
    assert first[2] == later[2] and first[4] == later[4]  # the texts' pieces
    assert first[1] != later[1] and tok.decode(later[3]) == "[12]"
    one = tok.encode("[1]", add_special_tokens=False)
    assert f.render_block(HITS[:2], 2, numbers=[7, 12]).leads == [[], [], one, [], one, []]  # texts after [1]
    block = f.render_block(HITS, 1)
    lines = "".join(f"[{i}] T{i}: {' '.join(h.text.split())}\n" for i, h in enumerate(HITS, 1))
    assert block.token_ids == enc("\n<evidence>\n") + enc(lines) + enc("</evidence>\n")


def test_a_cut_document_keeps_its_number_apart(tok):
    block = EvidenceFormatter(tok, budget=60).render_block(HITS, 1)
    pieces = [tok.decode(p) for p in _pieces(block)]
    assert block.truncated and len(pieces) == 5 and pieces[1] == "[1]"
    assert block.leads == [[], [], tok.encode("[1]", add_special_tokens=False), [], []]  # the cut text too
    assert pieces[2].startswith(" T1: word") and not pieces[2].endswith("\n")
    assert pieces[-2:] == [" …\n", "</evidence>\n"]


def test_a_tokenizer_that_would_split_the_line_otherwise_keeps_it_whole(tok):
    """Where tokenising the number apart would change the line's tokens, the line stays one piece."""

    class Joining:
        def __init__(self, inner):
            self.inner = inner

        def encode(self, text, add_special_tokens=False):  # a leading space becomes its own token
            ids = self.inner.encode(text.lstrip(" "), add_special_tokens=False)
            return [0, *ids] if text.startswith(" ") else ids

        def decode(self, ids):
            return self.inner.decode(ids)

    f = EvidenceFormatter(Joining(tok), budget=2000)
    block = f.render_block(HITS[:2], 1)
    assert block.leads == [[]] * 4
    assert len(block.segments) == 4 and block.token_ids[5 : 5 + block.segments[1]] == tok.encode(
        f"[1] T1: {' '.join(HITS[0].text.split())}\n", add_special_tokens=False)


def test_the_default_tokenizer_gives_every_line_its_whole_tokens(real):
    """With the default model's tokenizer, numbering a document apart changes no token id: every
    line of the synthetic corpus, under one- and two-digit numbers, is tokenised as it is whole."""
    from rig_decode.eval.synth import generate

    _, tokenizer = real
    f = EvidenceFormatter(tokenizer, budget=4000)
    docs = [Hit(d["id"], d["text"], 1.0, d["title"]) for d in generate(0)[0]]
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    for numbers in ([1], [2], [7], [12]):
        for hit in docs:
            block = f.render_block([hit], 1, numbers=numbers)
            assert len(block.segments) == 4  # head, number, text, tail
            line = f"[{numbers[0]}] {hit.title}: {' '.join(hit.text.split())}\n"
            head, *_, tail = block.segments
            assert block.token_ids[head:-tail] == enc(line), line
