"""Retrieval gate: veto, allow, boost, rules and thresholds at their boundaries; decisions traced."""

import pytest
import torch

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.gate import GateProcessor, GateRule, GateSettings, coverage, opening_ids
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import MarkersForever, ScriptedRetriever

ENTITY_Q = "Which release fixed error E1234 in Helios Gateway?"
CHAT_Q = "hello, how are you?"


def _row(engine, question):
    seq = engine.new_sequence(engine.tokenizer.encode(question), seq_id=0, question=question)
    return seq


def _logits(vocab_size, opening, p_open):
    """Logits with probability ``p_open`` spread over the opening tokens, the rest on token 5."""
    scores = torch.full((1, vocab_size), -1e9)
    scores[0, opening] = torch.log(torch.tensor(p_open / len(opening)))
    scores[0, 5] = torch.log(torch.tensor(1 - p_open))
    return scores


@pytest.fixture
def engine(model, tok):
    return RigEngine(model, tok, ScriptedRetriever(), EngineOptions(max_iterations=2))


def test_opening_tokens(tok, tok_special):
    special = MarkerVocab(tok_special, MarkerSpec.special_token())
    assert tok_special.convert_tokens_to_ids("<|retrieve|>") in opening_ids(special).tolist()
    text = MarkerVocab(tok, MarkerSpec.special_token())
    first = tok.encode("<|retrieve|>", add_special_tokens=False)[0]
    ids = opening_ids(text).tolist()
    assert first in ids and tok.eos_token_id not in ids


def test_coverage_of_key_terms():
    assert coverage(CHAT_Q, []) == 1.0  # nothing to look up
    assert coverage(ENTITY_Q, []) == 0.0
    assert coverage(ENTITY_Q, [(None, "Helios Gateway release 4.2 fixed error E1234")]) == 1.0
    # names need a document about them: release notes titled "Helios Gateway 4.2" cover Helios and
    # Gateway (title) and release, fixed, error (text), but only mention E1234
    assert coverage(ENTITY_Q, [("Helios Gateway 4.2", "This release fixed error E1234.")]) == 5 / 6


def test_a_name_mentioned_in_passing_is_not_covered():
    company = ("Bretrouven Labs", "Bretrouven Labs was founded by Nubil Satrail. It is headquartered in Soutrar.")
    assert coverage("Where was Nubil Satrail born?", [company]) == 0.0
    assert coverage("Who founded Bretrouven Labs?", [company]) == 1.0
    person = ("Nubil Satrail", "Nubil Satrail was born in Soutrar.")
    assert coverage("Where was Nubil Satrail born?", [company, person]) == 1.0


def test_veto_chit_chat_allow_a_lookup(engine):
    gate = GateProcessor(engine.vocab, GateSettings())
    opening = gate.opening
    chat, lookup = _row(engine, CHAT_Q), _row(engine, ENTITY_Q)
    s = gate.apply([chat], _logits(len(engine.vocab), opening, 0.9))
    assert torch.isinf(s[0, opening]).all() and chat.trace.gate[-1]["action"] == "veto"
    assert chat.trace.gate[-1]["subscores"]["need"] == 0.0
    s = gate.apply([lookup], _logits(len(engine.vocab), opening, 0.9))
    assert not torch.isinf(s[0, opening]).any() and lookup.trace.gate[-1]["action"] == "allow"
    d = lookup.trace.gate[-1]
    assert set(d["subscores"]) == {"marker_prob", "entropy", "need", "domain"} and d["reasons"]


def test_terms_the_knowledge_base_lacks_cannot_be_looked_up(engine):
    from rig_decode.retrieval.lexical import LexicalSearcher

    kb = LexicalSearcher(["Helios Gateway release 4.2 fixed error E1234.", "Bretrouven Labs was founded by Nubil Satrail."])
    assert kb.knows("E1234") and kb.knows("Helios Gateway") and kb.knows("satrail")
    assert not kb.knows("helpful") and not kb.knows("Helios Toaster") and not kb.knows("")
    thanks = "You're very helpful."
    assert coverage(thanks, []) == 0.0  # "helpful" is a key word ...
    assert coverage(thanks, [], kb.knows) == 1.0  # ... that no search could find
    assert coverage(ENTITY_Q, [], kb.knows) == 0.0
    gate = GateProcessor(engine.vocab, GateSettings(), knows=kb.knows)
    chat, lookup = _row(engine, thanks), _row(engine, ENTITY_Q)
    s = gate.apply([chat, lookup], _logits(len(engine.vocab), gate.opening, 0.9).repeat(2, 1))
    assert torch.isinf(s[0, gate.opening]).all() and not torch.isinf(s[1, gate.opening]).any()
    assert chat.trace.gate[-1]["reasons"][-1] == "none of the question's key terms occurs in the knowledge base"
    assert lookup.trace.gate[-1]["action"] == "allow"


def test_threshold_boundary_and_consider(engine):
    probe = GateProcessor(engine.vocab, GateSettings())
    row = _row(engine, ENTITY_Q)
    probe.apply([row], _logits(len(engine.vocab), probe.opening, 0.5))
    score = probe.score(row.trace.gate[-1]["subscores"])  # exactly the score the decision used
    at = GateProcessor(engine.vocab, GateSettings(threshold=score))
    above = GateProcessor(engine.vocab, GateSettings(threshold=score + 1e-9))
    r1, r2 = _row(engine, ENTITY_Q), _row(engine, ENTITY_Q)
    at.apply([r1], _logits(len(engine.vocab), probe.opening, 0.5))
    above.apply([r2], _logits(len(engine.vocab), probe.opening, 0.5))
    assert r1.trace.gate[-1]["action"] == "allow" and r2.trace.gate[-1]["action"] == "veto"
    quiet = _row(engine, ENTITY_Q)  # below ``consider``: no decision at all
    GateProcessor(engine.vocab, GateSettings(consider=0.2)).apply([quiet], _logits(len(engine.vocab), probe.opening, 0.19))
    assert quiet.trace.gate == []


def test_sensitive_rule_always_retrieves(engine):
    rules = (GateRule(r"\bhow are you\b", 1.0),)
    gate = GateProcessor(engine.vocab, GateSettings(threshold=0.99, rules=rules))
    row = _row(engine, CHAT_Q)
    s = gate.apply([row], _logits(len(engine.vocab), gate.opening, 0.9))
    assert not torch.isinf(s[0, gate.opening]).any() and row.trace.gate[-1]["subscores"]["domain"] == 1.0


def test_boost_when_unsure_without_evidence(engine):
    gate = GateProcessor(engine.vocab, GateSettings(boost=True, boost_entropy=1.0, boost_bias=8.0))
    row = _row(engine, ENTITY_Q)
    flat = torch.zeros(1, len(engine.vocab))  # uniform: maximal entropy, tiny opening mass
    before = torch.softmax(flat[0], -1)[gate.opening].sum()
    out = gate.apply([row], flat.clone())
    after = torch.softmax(out[0], -1)[gate.opening].sum()
    assert after > 10 * before and row.trace.gate[0]["action"] == "boost"
    off = GateProcessor(engine.vocab, GateSettings(boost=False))
    row2 = _row(engine, ENTITY_Q)
    assert torch.equal(off.apply([row2], flat.clone()), flat) and row2.trace.gate == []


def test_gate_in_the_engine(model, tok):
    """A model that always wants to retrieve: the gate lets a lookup question hop and keeps a
    chit-chat turn from retrieving at all."""
    opts = EngineOptions(max_iterations=1, max_new_tokens=30, gate=GateSettings(), newline_ends_query=False,
                         max_query_tokens=4)
    engine = RigEngine(model, tok, ScriptedRetriever(), opts)
    engine.processors.insert(0, MarkersForever(engine.vocab, tok.encode(" and", add_special_tokens=False)[0]))
    chat = engine.new_sequence(tok.encode(CHAT_Q), seq_id=0, question=CHAT_Q)
    lookup = engine.new_sequence(tok.encode(ENTITY_Q), seq_id=1, question=ENTITY_Q)
    engine.generate([chat, lookup])
    assert chat.trace.num_hops == 0 and {d["action"] for d in chat.trace.gate} == {"veto"}
    assert lookup.trace.num_hops == 1 and lookup.trace.gate[0]["action"] == "allow"
