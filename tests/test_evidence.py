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
