"""Citations: invalid numbers cannot be generated; each citation is checked against its document."""

import re

import pytest
import torch

from rig_decode.citations import CitationProcessor, _walk, check_citations, trace_docs
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.trace import RetrievedDoc

from .helpers import ScriptedRetriever


@pytest.mark.parametrize("state, data, limit, ok", [
    (None, b"see [2] and", 3, True),
    (None, b"[4]", 3, False),
    (None, b"[0]", 3, False),
    (None, b"[12", 12, True),
    (None, b"[13", 12, False),
    (None, b"[see below]", 0, True),
    (None, b"[1", 0, False),
    (b"1", b"]", 3, True),
    (b"1", b"0]", 3, False),
    (b"1", b" apples", 3, False),
    (b"", b"x", 3, True),
    (b"", b"[", 3, True),
])
def test_walk(state, data, limit, ok):
    assert _walk(state, data, limit) is ok


class Tempt:
    """After the hop, pushes hard (a large bias, not forcing) toward writing ``[9]``, ``[0]``,
    ``[1`` + ``5]`` and also a valid ``[2]``: each character in turn, again and again."""

    def __init__(self, tok, text: str):
        self.ids = [tok.encode(ch, add_special_tokens=False)[0] for ch in text]
        self.k = {}

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            if seq.trace.num_hops and not seq.matcher.is_open:
                k = self.k.get(seq.seq_id, 0)
                scores[i, self.ids[k % len(self.ids)]] += 1e4
                self.k[seq.seq_id] = k + 1
        return scores


def test_invalid_citations_cannot_be_generated(model, tok):
    opts = EngineOptions(max_iterations=1, max_new_tokens=90, evidence_token_budget=300, top_k=3, citations=True,
                         newline_ends_query=False)
    engine = RigEngine(model, tok, ScriptedRetriever(), opts)
    marker = engine.vocab.marker_token_ids("release 4.2.1")
    tempt = Tempt(tok, "[9][0][15][2] ")

    class First:
        def apply(self, rows, scores):
            for i, seq in enumerate(rows):
                if seq.num_generated < len(marker):
                    scores[i].fill_(float("-inf"))
                    scores[i, marker[seq.num_generated]] = 0.0
            return scores

    engine.processors[:0] = [First(), tempt]
    seq = engine.new_sequence(tok.encode("Which release fixed E1234?"), seq_id=0)
    engine.generate([seq])
    assert seq.trace.num_hops == 1 and len(seq.trace.retrieval_steps[0].docs) == 3
    text = seq.matcher.visible_text()
    cited = [int(n) for n in re.findall(r"\[(\d+)", text)]
    assert cited, f"the model never got to cite: {text!r}"
    assert all(1 <= n <= 3 for n in cited), text
    assert "[2]" in text  # a valid citation goes through


def test_without_evidence_nothing_can_be_cited(model, tok):
    opts = EngineOptions(max_iterations=0, max_new_tokens=40, citations=True)
    engine = RigEngine(model, tok, ScriptedRetriever(), opts)
    ids = [tok.encode(ch, add_special_tokens=False)[0] for ch in "[1]"]

    class Push:
        def apply(self, rows, scores):
            for i, seq in enumerate(rows):
                scores[i, ids[seq.num_generated % 3]] += 1e4
            return scores

    engine.processors.insert(0, Push())
    seq = engine.new_sequence(tok.encode("Hello"), seq_id=0)
    engine.generate([seq])
    assert not re.search(r"\[\d", seq.matcher.visible_text())


def test_state_follows_the_generated_text(tok):
    from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab

    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    m = MarkerMatcher(vocab)
    for t in tok.encode("Answer [1", add_special_tokens=False):
        m.feed(t)
    assert CitationProcessor.state(m) == b"1"
    for t in tok.encode("] more [", add_special_tokens=False):
        m.feed(t)
    assert CitationProcessor.state(m) == b""


def test_check_citations_maps_and_flags():
    docs = [RetrievedDoc("rel-421", "Release 4.2.1", 0.9, "dense", 1, "Release 4.2.1 fixed error E1234."),
            RetrievedDoc("appr", "Approval", 0.8, "bm25", 2, "Priya Raman approved release 4.2.1 on 2026-01-14.")]
    answer = "Release 4.2.1 fixed E1234 [1]. Priya Raman approved it [2]. Tomas Berg approved it on 1999-01-01 [2]."
    cites = check_citations(answer, docs)
    assert [(c.number, c.doc_id, c.valid, c.supported) for c in cites] == [
        (1, "rel-421", True, True), (2, "appr", True, True), (2, "appr", True, False)]
    assert "1999-01-01" in cites[2].missing_terms
    bad = check_citations("Something [7].", docs)
    assert bad[0].valid is False and bad[0].doc_id is None


def test_session_trace_lists_citations(model, tok):
    from rig_decode.config import RigConfig
    from rig_decode.session import RigSession

    cfg = RigConfig.from_dict({"rig": {"citations": True, "max_iterations": 1}, "model": {"max_tokens": 30}})
    session = RigSession(cfg, model=model, tokenizer=tok, retriever=ScriptedRetriever())
    _, trace = session.ask("Which release fixed error E1234?")
    assert isinstance(trace.citations, list)
    assert all(c["valid"] for c in trace.citations)
    assert trace_docs(trace) == [d for s in trace.retrieval_steps for d in s.docs]


def test_fixed_bans_outside_a_number_are_the_bans_and_inside_one_none(tok):
    """What a server may apply for the citation rule: outside a citation's number the ids ``apply``
    bans (and nothing else changes), inside one None (only some digits are allowed)."""
    from types import SimpleNamespace

    from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab
    from rig_decode.trace import Trace

    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    proc, row = CitationProcessor(vocab), SimpleNamespace(matcher=MarkerMatcher(vocab), trace=Trace())
    seen, banned = [], []
    for t in tok.encode("Answer [1] and [", add_special_tokens=False):
        row.matcher.feed(t)
        scores = torch.randn(1, len(tok))
        out, bans = proc.apply([row], scores.clone()), proc.fixed_bans(row)
        seen.append(bans is None)
        if bans is None:
            assert CitationProcessor.state(row.matcher)  # mid-number
            continue
        expect = scores.clone()
        expect[0, sorted(bans)] = float("-inf")
        assert torch.equal(out, expect)
        banned.append(len(bans))
    assert any(seen) and banned[-1]  # after the last "[", with no evidence seen: every digit banned
