"""Faults stay where they happen (DESIGN invariant 8): whatever a retriever returns or does, the
batch finishes, the fault is in its hop's trace, and the next clean request gets evidence."""

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rig_decode import RigConfig, RigSession
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.retrieval_worker import RetrievalWorker
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.retrieval.base import Hit
from rig_decode.retrieval.chaos import FAULTS, MODES, FaultyRetriever, fault_recorded

from .helpers import ForceScript, ScriptedRetriever

TIMEOUT_S = 0.3


class Switch:
    """A fault plan: ``mode`` on every call while ``on``."""

    def __init__(self, mode=None):
        self.mode, self.on = mode, mode is not None

    def __call__(self, call, queries):
        return self.mode if self.on else None


def marker(tok, q):
    return MarkerVocab(tok, MarkerSpec.special_token()).marker_token_ids(q)


def faulty_session(model, tok, plan, **engine):
    cfg = RigConfig().updated(model={"max_tokens": 40}, retriever={"timeout_s": TIMEOUT_S}, engine=engine)
    retriever = FaultyRetriever(ScriptedRetriever(), plan, hang_s=30)
    s = RigSession(cfg, model=model, tokenizer=tok, retriever=retriever)
    # row 0 searches at once, row 1 a few tokens later and again later still: hops at different steps
    s.engine.processors.insert(0, ForceScript({0: {0: marker(tok, "E1234 fixed")},
                                               1: {3: marker(tok, "approved by"), 16: marker(tok, "clause 7.1")}}))
    return s, retriever


def assert_clean_request_gets_evidence(session):
    answer, trace = session.ask("Which release fixed error E1234?")
    step = trace.retrieval_steps[0]
    assert step.error is None and step.docs and step.docs[0].id.startswith("d"), step
    assert trace.finish_reason in ("stop", "length")


def check_faulty_batch(session, retriever, mode):
    out = session.ask_batch(["Which release fixed error E1234?", "Who approved it?"])
    assert [t.finish_reason in ("stop", "length") for _, t in out] == [True, True]
    steps = [step for _, t in out for step in t.retrieval_steps]
    assert len(steps) == 3  # one step per marker: nothing lost, nothing doubled
    dealt = {q for inj in retriever.injected if inj.mode == mode for q in inj.queries}
    assert dealt, "the fault was never injected"
    for step in steps:
        if step.query in dealt:
            assert fault_recorded(mode, step), (mode, step)
    return steps


@pytest.mark.parametrize("mode", FAULTS)
def test_each_fault_is_recorded_and_the_next_request_gets_evidence(model, tok, mode):
    plan = Switch(mode)
    session, retriever = faulty_session(model, tok, plan)
    try:
        steps = check_faulty_batch(session, retriever, mode)
        if mode in ("nan", "text_none", "non_hit"):  # the bad hit is dropped, the good ones stay
            assert all(s.docs and s.info["dropped_hits"] == 1 and s.error is None for s in steps)
        if mode == "huge":
            assert all(s.info["clipped_texts"] == 1 and s.info.get("evidence_cut") for s in steps)
            assert all(s.evidence_tokens <= session.config.rig.evidence_token_budget for s in steps)
        if mode == "hang":
            assert all("timed out" in s.error for s in steps)
            assert all(s.latency_ms < (TIMEOUT_S + 1.0) * 1e3 for s in steps)
        plan.on = False
        assert_clean_request_gets_evidence(session)
        assert session.engine.retrieval_health()["status"] == "ok"
    finally:
        retriever.release()
        session.close()


def test_all_faults_in_sequence_leave_no_damage(model, tok):
    plan = Switch()
    session, retriever = faulty_session(model, tok, plan)
    try:
        for mode in MODES:
            plan.mode, plan.on = mode, True
            if mode != "slow":
                check_faulty_batch(session, retriever, mode)
            plan.on = False
            assert_clean_request_gets_evidence(session)
        assert session.engine.retrieval_health()["status"] == "ok"
        assert not session.engine.running and not session.engine.waiting
    finally:
        retriever.release()
        session.close()


@pytest.mark.real_model
def test_faults_on_the_default_model_and_retriever(real):
    """The public API as a user runs it: the embedded model, the hybrid demo retriever, a forced
    first hop; every fault in turn, each followed by a clean request that must get evidence (after
    the hung searches have ended)."""
    from rig_decode.retrieval.factory import build_retriever

    assert FAULTS[-1] == "hang"  # its release() below lets every later call through
    cfg = RigConfig().updated(model={"max_tokens": 24}, rig={"retrieve_first": True},
                              retriever={"timeout_s": 1.0})
    plan = Switch()
    retriever = FaultyRetriever(build_retriever(cfg.retriever), plan, hang_s=30)
    session = RigSession(cfg, retriever=retriever)
    questions = ["Who founded the company that makes the Brisa T4?", "In which city is the maker of the Lumora K7?"]
    try:
        for mode in FAULTS:
            plan.mode, plan.on = mode, True
            out = session.ask_batch(questions)
            for _, trace in out:
                assert trace.finish_reason in ("stop", "length") and trace.retrieval_steps
                assert fault_recorded(mode, trace.retrieval_steps[0]), (mode, trace.retrieval_steps[0])
            plan.on = False
            if mode == "hang":  # the last fault: a model that searches once per hop can leave more hung
                # searches than engine.max_hung_searches, and retrieval is then degraded, by design, until
                # they end (test_past_the_cap_of_hung_searches_retrieval_is_degraded_then_recovers)
                retriever.release()
                deadline = time.monotonic() + 10
                while session.engine.retrieval_health()["status"] != "ok" and time.monotonic() < deadline:
                    time.sleep(0.05)
            _, trace = session.ask(questions[0])
            first = trace.retrieval_steps[0]
            assert first.error is None and first.docs, (mode, first)
    finally:
        retriever.release()
        session.close()


# -- the worker -------------------------------------------------------------------------------------


def drain(worker, n, timeout=5.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        worker.wait(0.05)
        out += worker.poll()
    return out


def test_a_hung_search_is_abandoned_and_the_queue_moves_on():
    gate, hanging = threading.Event(), threading.Event()

    class HangsOnce(ScriptedRetriever):
        def search_batch(self, queries, top_k, filters=None):
            if "stuck" in queries:
                hanging.set()
                gate.wait(10)
            return super().search_batch(queries, top_k, filters)

    w = RetrievalWorker(HangsOnce(), top_k=2, timeout_s=0.2, max_hung=2)
    try:
        t1 = w.submit(1, "stuck")
        w.flush()
        assert hanging.wait(5)
        t2 = w.submit(2, "next")  # queued behind the hung call
        results = {r.ticket: r for r in drain(w, 2)}
        assert "timed out" in results[t1].error and not results[t1].hits
        assert results[t2].error is None and results[t2].hits  # served by a new search thread
        assert w.health()["status"] == "ok" and w.health()["hung_searches"] == 1
        gate.set()
        assert drain(w, 1, timeout=0.5) == []  # the hung call's late result is dropped
        assert w.health()["hung_searches"] == 0
    finally:
        gate.set()
        w.close()


def test_past_the_cap_of_hung_searches_retrieval_is_degraded_then_recovers():
    gate = threading.Event()
    w = RetrievalWorker(FaultyRetriever(ScriptedRetriever(), lambda c, q: "hang" if "stuck" in q else None,
                                        hang_s=10), top_k=2, timeout_s=0.1, max_hung=1)
    w.retriever._released = gate
    try:
        w.submit(1, "stuck")
        assert "timed out" in drain(w, 1)[0].error
        health = w.health()
        assert health["status"] == "degraded" and "1 searches still running" in health["reason"]
        t0 = time.perf_counter()
        w.submit(2, "fine")
        refused = w.poll()  # answered at once, no wait
        assert time.perf_counter() - t0 < 1.0 and "retrieval degraded" in refused[0].error  # the hang is 10 s
        gate.set()
        deadline = time.monotonic() + 5
        while w.health()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.01)
        w.submit(3, "fine")
        served = drain(w, 1)
        assert served[0].error is None and served[0].hits
    finally:
        gate.set()
        w.close()


def test_a_dead_search_thread_is_noticed_and_replaced():
    w = RetrievalWorker(ScriptedRetriever(), top_k=2, timeout_s=5)
    real_run = w._run

    def dies(lane):  # takes its batch, then the thread ends without answering
        with w._cond:
            lane.batch, lane.started, w._queue = w._queue, time.perf_counter(), []

    w._run = dies
    try:
        t = w.submit(1, "lost")
        w.flush()
        w._lane.thread.join(2)
        [r] = drain(w, 1)
        assert r.ticket == t and "ended unexpectedly" in r.error and w.health()["restarts"] == 1
        w._run = real_run
        w.submit(2, "fine")
        [r] = drain(w, 1)
        assert r.error is None and r.hits
    finally:
        w.close()


def test_a_retriever_raising_base_exceptions_fails_only_its_batch():
    class Exits(ScriptedRetriever):
        def search_batch(self, queries, top_k, filters=None):
            if "exit" in queries:
                raise SystemExit("plugin called sys.exit")
            return super().search_batch(queries, top_k, filters)

    w = RetrievalWorker(Exits(), top_k=2, retries=0)
    try:
        w.submit(1, "exit")
        assert "SystemExit" in drain(w, 1)[0].error
        w.submit(2, "fine")
        assert drain(w, 1)[0].hits
    finally:
        w.close()


# -- per-row isolation in the engine ----------------------------------------------------------------


def two_row_engine(model, tok, **opts):
    base = dict(max_iterations=2, max_new_tokens=24, evidence_token_budget=48, top_k=2)
    script = {0: {1: marker(tok, "poison")}, 1: {2: marker(tok, "E1234")}}
    return RigEngine(model, tok, ScriptedRetriever(), EngineOptions(**{**base, **opts}),
                     extra_processors=[ForceScript(script)])


class Poisons(ScriptedRetriever):
    """The query "poison" gets a (valid) hit that the poisoned renderer below cannot render."""

    def search_batch(self, queries, top_k, filters=None):
        out = super().search_batch(queries, top_k, filters)
        return [[Hit("poison", "a text", 1.0)] if q == "poison" else hits for q, hits in zip(queries, out)]


def test_a_row_whose_evidence_cannot_be_rendered_fails_alone(model, tok):
    e = two_row_engine(model, tok)
    e.worker.retriever = Poisons()
    render = e.formatter.render_block

    def poisoned(hits, hop, budget=None, numbers=None):
        if any(h.doc_id == "poison" for h in hits):
            raise AttributeError("'NoneType' object has no attribute 'split'")
        return render(hits, hop, budget, numbers)

    e.formatter.render_block = poisoned
    a, b = e.generate([e.new_sequence(tok.encode("first"), 0), e.new_sequence(tok.encode("second"), 1)])
    [bad] = a.trace.retrieval_steps
    assert "could not be rendered" in bad.error and bad.fallback == "no-evidence block" and not bad.docs
    assert a.finish_reason in ("stop", "length")
    [good] = b.trace.retrieval_steps
    assert good.error is None and good.docs and b.finish_reason in ("stop", "length")


def test_a_failed_summary_eviction_ends_that_row_and_no_other(model, tok):
    script = {0: {1: marker(tok, "one"), 16: marker(tok, "two")}, 1: {2: marker(tok, "E1234"), 18: marker(tok, "x")}}
    e = RigEngine(model, tok, ScriptedRetriever(), EngineOptions(max_iterations=2, max_new_tokens=40,
                                                                 evidence_token_budget=48, top_k=2,
                                                                 append_format="summary"),
                  extra_processors=[ForceScript(script)])
    evict = e.runner.evict

    def fails_for_row_zero(row, start, end):
        if e.running[row].seq_id == 0:
            raise RuntimeError("device lost")
        return evict(row, start, end)

    e.runner.evict = fails_for_row_zero
    a, b = e.generate([e.new_sequence(tok.encode("first"), 0), e.new_sequence(tok.encode("second"), 1)])
    assert a.finish_reason == "error" and len(a.trace.retrieval_steps) == 2
    assert "summary eviction failed: RuntimeError" in a.trace.retrieval_steps[1].error
    assert b.finish_reason in ("stop", "length") and len(b.trace.retrieval_steps) == 2
    assert b.trace.evicted_tokens > 0 and all(s.error is None for s in b.trace.retrieval_steps)
    assert not e.running and e.runner.batch_size == 0
    e.runner.evict = evict
    [c] = e.generate([e.new_sequence(tok.encode("third"), 0)])
    assert c.finish_reason in ("stop", "length")


def test_a_failing_reuse_lookup_searches_instead(model, tok, monkeypatch):
    import rig_decode.engine.hops as hops

    def broken(*a, **k):
        raise KeyError("numbers")

    monkeypatch.setattr(hops, "find_reuse", broken)
    e = two_row_engine(model, tok, reuse_similarity=0.8)
    a, _ = e.generate([e.new_sequence(tok.encode("first"), 0), e.new_sequence(tok.encode("second"), 1)])
    [step] = a.trace.retrieval_steps
    assert step.docs and step.error is None and "KeyError" in step.info["reuse_error"]


def test_duplicate_seq_ids_are_refused(model, tok):
    e = two_row_engine(model, tok)
    s = e.new_sequence(tok.encode("first"), 0)
    e.add(s)
    with pytest.raises(ValueError, match="seq_id 0 is already in this engine"):
        e.add(e.new_sequence(tok.encode("second"), 0))
    with pytest.raises(ValueError, match="the same sequence twice"):
        e.add(s)
    while e.has_unfinished:
        e.step()
    [again] = e.generate([e.new_sequence(tok.encode("again"), 0)])  # a finished id may be used again
    assert again.is_finished


class OverdueAt:
    """Makes a row overdue on the step that samples its ``k``-th generated token."""

    def __init__(self, k):
        self.k = k

    def apply(self, rows, scores):
        for row in rows:
            if row.num_generated == self.k - 1:
                row.deadline_at = time.perf_counter() - 1
        return scores


@pytest.mark.parametrize("reason", ["context_full", "deadline"])
def test_a_marker_completed_as_the_row_ends_gets_its_step(model, tok, reason, monkeypatch):
    m = marker(tok, "late")
    prompt = tok.encode("first")
    processors = [ForceScript({0: {0: m}})] + ([OverdueAt(len(m))] if reason == "deadline" else [])
    e = RigEngine(model, tok, ScriptedRetriever(), EngineOptions(max_new_tokens=64, evidence_token_budget=48),
                  extra_processors=processors)
    if reason == "context_full":  # full exactly when the marker completes
        monkeypatch.setattr(type(e.runner), "context_limit", property(lambda self: len(prompt) + len(m)))
    [seq] = e.generate([e.new_sequence(prompt, 0)])
    assert seq.finish_reason == reason and seq.num_generated == len(m)
    [step] = seq.trace.retrieval_steps
    assert step.query == "late" and "no retrieval" in step.error


# -- chaos ------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(faults=st.lists(st.sampled_from((None, None, *MODES)), min_size=1, max_size=12),
       starts=st.lists(st.integers(0, 8), min_size=2, max_size=5),
       second_hop=st.lists(st.booleans(), min_size=5, max_size=5))
def test_chaos_every_request_finishes_in_time_and_every_fault_is_recorded(model, tok, faults, starts, second_hop):
    """A random fault per search over a ragged batch whose rows hop at different steps: each
    request ends, within its token budget, having waited for evidence no longer than its hops'
    timeouts (plus a step each: timeouts are seen between steps), and each dealt fault is in a
    trace. (Decoding time depends on the machine's load, not on faults: it is not bounded here.)"""
    timeout = 0.2
    plan = lambda call, queries: faults[(call - 1) % len(faults)]  # noqa: E731
    retriever = FaultyRetriever(ScriptedRetriever(), plan, hang_s=5, slow_s=0.05)
    script = {i: {at: marker(tok, f"row {i} hop 1"), **({at + 20: marker(tok, f"row {i} hop 2")} if again else {})}
              for i, (at, again) in enumerate(zip(starts, second_hop))}
    e = RigEngine(model, tok, retriever, EngineOptions(max_iterations=2, max_new_tokens=48, evidence_token_budget=48,
                                                       top_k=2, retrieval_timeout_s=timeout, max_hung_searches=2),
                  extra_processors=[ForceScript(script)])
    prompts = ["Which release fixed error E1234?", "Who approved it?", "q", "Search for the fact", "Grüße 東京"]
    try:
        seqs = e.generate([e.new_sequence(tok.encode(prompts[i]), i) for i in range(len(starts))])
        steps = {}
        for s in seqs:
            assert s.finish_reason in ("stop", "length"), s.trace.marker_errors
            hops, slack = s.trace.num_hops, 1.0
            assert s.num_generated <= 48 and 1 <= hops <= 2
            assert s.trace.parked_ms <= hops * (timeout + slack) * 1e3, (hops, s.trace.parked_ms)
            for step in s.trace.retrieval_steps:
                assert step.latency_ms <= (timeout + slack) * 1e3, step
                steps[step.query] = step
        for inj in retriever.injected:
            for q in inj.queries:
                assert fault_recorded(inj.mode, steps[q]), (inj.mode, steps[q])
    finally:
        retriever.release()
        e.close()


def test_a_logits_processor_failing_on_one_row_ends_that_row_alone(model, tok):
    class FailsOnRowOne:
        def apply(self, rows, scores):
            if any(r.seq_id == 1 and r.num_generated == 5 for r in rows):
                raise IndexError("citation number out of range")
            return scores

    prompts = [tok.encode("first"), tok.encode("second")]
    alone = two_row_engine(model, tok)
    [expected] = alone.generate([alone.new_sequence(prompts[0], 0)])
    e = two_row_engine(model, tok)
    e.processors.insert(0, FailsOnRowOne())
    a, b = e.generate([e.new_sequence(p, i) for i, p in enumerate(prompts)])
    assert b.finish_reason == "error" and b.num_generated == 5
    assert "applying logits processors: IndexError" in b.trace.engine_errors[-1]
    assert not b.trace.marker_errors  # the engine failed, not the model's marker
    assert a.token_ids == expected.token_ids and a.finish_reason == expected.finish_reason


def test_a_row_by_row_retry_starts_from_the_raw_logits(model, tok):
    """When a processor fails on the batch, each row runs the processors again from the step's raw
    logits: one that is not idempotent (negating the scores) is applied once, not twice, to the
    rows that go on."""
    class Negate:
        def apply(self, rows, scores):
            return scores.neg_()

    class FailsOnRowOne:
        def apply(self, rows, scores):
            if any(r.seq_id == 1 and r.num_generated == 0 for r in rows):  # row 0 samples freely then
                raise IndexError("citation number out of range")
            return scores

    prompts = [tok.encode("first"), tok.encode("second")]
    alone = two_row_engine(model, tok)
    alone.processors.insert(0, Negate())
    [expected] = alone.generate([alone.new_sequence(prompts[0], 0)])
    e = two_row_engine(model, tok)
    e.processors[:0] = [Negate(), FailsOnRowOne()]
    a, b = e.generate([e.new_sequence(p, i) for i, p in enumerate(prompts)])
    assert b.finish_reason == "error" and b.num_generated == 0
    assert a.token_ids == expected.token_ids
