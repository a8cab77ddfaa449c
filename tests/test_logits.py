"""Termination by construction: the hop budget and the query cap hold against a model that wants
to retrieve forever, in the engine and inside plain ``model.generate``."""

import pytest
import torch
from transformers import LogitsProcessorList

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.sampling import greedy
from rig_decode.logits import MarkerTracker, marker_processors
from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab

from .helpers import MarkersForever, ScriptedRetriever


@pytest.mark.parametrize("style", ["special_token", "json"])
@pytest.mark.parametrize("max_iterations", [0, 1, 3])
def test_engine_terminates_against_a_marker_forever_model(model, tok, style, max_iterations):
    vocab = MarkerVocab(tok, MarkerSpec.from_style(style))
    filler = tok.encode(" a")[0]
    opts = EngineOptions(max_iterations=max_iterations, max_query_tokens=6, marker_style=style,
                         max_new_tokens=120, evidence_token_budget=40)
    engine = RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=[MarkersForever(vocab, filler)],
                       vocab=vocab)
    seqs = engine.generate([engine.new_sequence(tok.encode("go"), 0), engine.new_sequence(tok.encode("go on"), 1)])
    for s in seqs:
        assert s.finish_reason == "length"
        assert s.trace.num_hops == max_iterations
        assert s.num_generated == 120
        # every query was cut at the cap: at most 6 query tokens + the forced end delimiter
        assert all(len(step.query.split()) <= 6 for step in s.trace.retrieval_steps)
        assert not s.matcher.is_open or max_iterations == 0


def test_processors_inside_plain_generate(model, tok):
    """The same processors bound the loop inside ``model.generate`` (no retrieval there)."""
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    filler = tok.encode(" a")[0]
    adversary = MarkersForever(vocab, filler)
    procs = marker_processors(vocab, max_iterations=2, max_query_tokens=5, stop_ids=[tok.eos_token_id])
    tracker = procs[0].tracker

    class Adversary:  # the HF signature, reading the tracker the processors share
        def __call__(self, input_ids, scores):
            return adversary.apply(tracker.sync(input_ids), scores)

    prompt = torch.tensor([tok.encode("go"), tok.encode("ok")])
    out = model.generate(prompt, max_new_tokens=100, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([Adversary(), *procs]))
    for row in out[:, prompt.shape[1]:].tolist():
        m = MarkerMatcher(vocab)
        events = [e for t in row for e in m.feed(t)]
        assert sum(e.kind == "marker" for e in events) == 2
        assert not m.is_open


def test_no_stop_inside_an_open_query(model, tok):
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    eos = tok.eos_token_id
    (proc, *_rest) = [p for p in marker_processors(vocab, 3, 48, [eos]) if type(p).__name__ == "NoStopInQueryProcessor"]
    tracker = MarkerTracker(vocab)
    rows = tracker.sync(torch.tensor([[5], [5]]))
    for t in tok.encode("<|retrieve|>abc"):
        rows[0].matcher.feed(t)
    scores = proc.apply(rows, torch.zeros(2, len(tok)))
    assert scores[0, eos] == float("-inf") and scores[1, eos] == 0


def test_a_whole_end_delimiter_is_banned_outside_a_marker(tok, tok_special):
    """With the delimiters as added tokens, ``<|endofretrieve|>`` cannot be written outside a
    marker; inside one it can. A tokenizer that spells the delimiter in pieces bans nothing."""
    vocab = MarkerVocab(tok_special, MarkerSpec.special_token())
    start, end = tok_special.convert_tokens_to_ids(["<|retrieve|>", "<|endofretrieve|>"])
    assert vocab.whole_end_ids.tolist() == [end]
    (proc,) = [p for p in marker_processors(vocab, 3, 48, [0]) if type(p).__name__ == "StrayEndProcessor"]
    rows = MarkerTracker(vocab).sync(torch.tensor([[5], [5]]))
    rows[1].matcher.feed(start)
    scores = proc.apply(rows, torch.zeros(2, len(tok_special)))
    assert scores[0, end] == float("-inf") and scores[1, end] == 0
    assert len(MarkerVocab(tok, MarkerSpec.special_token()).whole_end_ids) == 0


def test_newline_in_query_becomes_the_end_marker(model, tok):
    """A model that ends its query with a line break gets a real end marker instead."""
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    newline = tok.encode("\n")[0]

    class WantsNewline:
        def apply(self, rows, scores):
            for i, r in enumerate(rows):
                if r.matcher.is_open and r.matcher.query_num_tokens >= 2:
                    scores[i, newline] += 100.0
            return scores

    script = {0: {0: tok.encode("<|retrieve|>E1234")}}
    from .helpers import ForceScript

    opts = EngineOptions(max_iterations=1, max_new_tokens=30, evidence_token_budget=40)
    engine = RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=[ForceScript(script), WantsNewline()])
    s = engine.generate([engine.new_sequence(tok.encode("q"), 0)])[0]
    assert s.trace.num_hops == 1 and s.trace.retrieval_steps[0].query.startswith("E1234")


def test_retrieve_first_forces_one_hop_with_the_models_query(model, tok):
    opts = EngineOptions(max_iterations=2, max_new_tokens=30, max_query_tokens=5, retrieve_first=True,
                         evidence_token_budget=40)
    engine = RigEngine(model, tok, ScriptedRetriever(), opts)
    s = engine.generate([engine.new_sequence(tok.encode("question"), 0)])[0]
    start_len = len(tok.encode("<|retrieve|>"))
    assert s.trace.num_hops >= 1 and s.trace.retrieval_steps[0].query
    gen = s.mask[s.num_prompt_tokens:]
    assert gen[:start_len] == [0] * start_len and 1 in gen[start_len:]  # forced start, model's own query
    off = RigEngine(model, tok, ScriptedRetriever(), EngineOptions(max_iterations=0, retrieve_first=True,
                                                                   max_new_tokens=10))
    assert off.generate([off.new_sequence(tok.encode("question"), 0)])[0].trace.num_hops == 0


def test_greedy_is_argmax_and_a_lone_finite_score_reads_as_forced():
    """The sampler's greedy pick (numpy on float32 CPU rows, torch otherwise) is torch's argmax, the
    first of equal maxima, and a row is forced exactly when one score is finite; the scores stay as
    they were (temperature sampling reads them next)."""
    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    x[1, 5] = x[1, 9] = x[1].max() + 1  # a tie: the first one wins
    x[2] = float("-inf")
    x[2, 7] = 3.0  # a processor forced token 7
    x[3] = float("-inf")
    x[3, [8, 7]] = 3.0  # two tokens left: not forced
    x[4] = -30.0
    x[4, 2] = -1.0  # a remote row: the top scores over a finite floor
    for scores in (x, x.double()):
        before = scores.clone()
        tokens, forced = greedy(scores)
        assert tokens == before.argmax(-1).tolist() and tokens[1] == 5 and tokens[3] == 7
        assert forced == (torch.isfinite(before).sum(-1) == 1).tolist() == [False, False, True, False, False, False]
        assert torch.equal(scores, before)


@pytest.mark.parametrize("style", ["special_token", "json"])
def test_fixed_bans_are_what_apply_does_or_none(tok, tok_special, style):
    """``fixed_bans`` (what a server may apply for the engine) agrees with ``apply`` at every position
    of a text with two markers, partial delimiters and a newline in a query: where it names bans,
    ``apply`` sets exactly those ids to -inf and leaves every other score as it was; where it says
    None, ``apply`` changed the row in some other way (it forced a token or moved probability)."""
    from types import SimpleNamespace

    tokenizer = tok_special if style == "special_token" else tok
    spec = MarkerSpec.from_style(style)
    vocab = MarkerVocab(tokenizer, spec)
    procs = marker_processors(vocab, max_iterations=2, max_query_tokens=4, stop_ids=[tokenizer.eos_token_id],
                              retrieve_first=True)
    text = ("Hi" + spec.render("who founded it") + " It was " + spec.start[0] + "a\nb" + spec.end[0] + " then "
            + spec.start[0][:3] + " more" + spec.render("x") + " done")
    ids = tokenizer.encode(text, add_special_tokens=False)
    row = SimpleNamespace(matcher=MarkerMatcher(vocab))
    seen = {"bans": 0, "none": 0}
    torch.manual_seed(0)
    for t in [None, *ids]:
        if t is not None:
            row.matcher.feed(t)
        for p in procs:
            scores = torch.randn(1, len(vocab))
            out = p.apply([row], scores.clone())
            bans = p.fixed_bans(row)
            if bans is None:
                seen["none"] += 1
                assert not torch.equal(out, scores), (type(p).__name__, t)  # it forced or moved probability
                continue
            seen["bans"] += bool(bans)
            expect = scores.clone()
            expect[0, sorted(bans)] = float("-inf")
            assert torch.equal(out, expect), (type(p).__name__, t)
    assert seen["bans"] and seen["none"]


def test_a_greedy_token_that_outweighs_the_newline_pool_is_the_scored_paths_pick(tok_special):
    """Inside a query the newline rule pools every line-break token's probability into the end
    delimiter. ``PickRule.outweighs`` says from a server's top log-probabilities alone whether its
    greedy token is still the pick: wherever it says so, the scored path (the top list written as the
    runners write it, the processors, greedy) picks that token; it says so for most confident
    positions, and not where the pool wins or comes within its margin."""
    import math
    from types import SimpleNamespace

    import numpy as np

    from rig_decode.engine.runner_remote import BELOW_TOP, RemoteRunner
    from rig_decode.engine.sampling import Sampler

    vocab = MarkerVocab(tok_special, MarkerSpec.special_token())
    eos = tok_special.eos_token_id
    sampler = Sampler(marker_processors(vocab, max_iterations=2, max_query_tokens=48, stop_ids=[eos]), EngineOptions())
    row = SimpleNamespace(matcher=MarkerMatcher(vocab), temperature=None, top_p=None, is_finished=False)
    for t in tok_special.encode(MarkerSpec.special_token().start[0] + "who wrote", add_special_tokens=False):
        row.matcher.feed(t)
    assert row.matcher.is_open
    rule = sampler.pick_rule(row)
    newline, end = set(vocab.newline_ids.tolist()), row.matcher.next_forced_end()
    assert rule.pooled == frozenset(newline | {end}) and eos in rule.bans

    runner = RemoteRunner(None, len(vocab), context_limit=1024)  # only its writer is used: no server

    def scored_pick(top):  # the list written as a runner writes it, then the processors and greedy
        scores = torch.empty((1, len(vocab)))
        runner._write_scores(scores[0], top)
        return sampler.sample([row], scores, [0], 0.0).tokens[0]

    rng = np.random.default_rng(0)
    plain = [t for t in range(len(vocab)) if t not in newline and t not in rule.bans and t != end]
    pool = sorted(newline)[:3]  # the line-break tokens listed (any others sit at the floor)
    taken = pool_won = 0
    for case in range(400):
        ids = list(rng.choice(plain, 19 - len(pool), replace=False)) + pool + [end]
        logits = rng.normal(0.0, 1.0 + case % 4, len(ids))
        logprobs = logits - np.logaddexp.reduce(np.append(logits, 0.0))  # some mass left off the list
        top = sorted(((int(t), float(lp)) for t, lp in zip(ids, logprobs)), key=lambda kv: -kv[1])
        g = top[0][0]
        pick = scored_pick(top)
        if rule.outweighs(g, top, BELOW_TOP):
            taken += 1
            assert pick == g, (case, top[:3])
        pool_won += pick == end
    assert 100 < taken < 400 and pool_won > 20, (taken, pool_won)
    g = plain[0]  # the pool just under the token: still the token's, but inside the margin
    close = [(g, math.log(0.5)), (end, math.log(0.5) - 1e-4)]
    assert scored_pick(close) == g and not rule.outweighs(g, close, BELOW_TOP)
    assert rule.into == end and rule.outweighs(end, [(end, -0.1), (g, -3.0)], BELOW_TOP)  # pooling only raises it
    assert scored_pick([(end, -0.1), (g, -3.0)]) == end
    for t in newline:  # the pool's other tokens are never the pick
        assert not rule.outweighs(t, [(t, -0.1), (g, -3.0)], BELOW_TOP) and scored_pick([(t, -0.1), (g, -3.0)]) == end
