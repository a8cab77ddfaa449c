"""``bench/resubmit.py``: the string-resubmit loop over a scripted client (no model, no server)
answers as the script says, searches in lockstep rounds, stops where it should, and counts what
re-tokenising the text changed; its llama-server client retries a dropped connection."""

import time

import httpx
import pytest

from rig_decode.markers import MarkerSpec
from rig_decode.prompt import build_prompt

from .helpers import ScriptedRetriever, load_script, tiny_tokenizer
from .peers_helpers import ANSWERS, END, QUERIES, QUESTIONS, START, Policy, PolicyModel
from .remote_helpers import FakeLlamaServer

resubmit = load_script("bench/resubmit.py")

LOOP = dict(max_iterations=3, top_k=2, evidence_budget=96, context_limit=2048)


class PolicyClient:
    """A resubmit client over the scripted policy: each request generates until EOS, its stop string
    (kept in the output, as vLLM's ``include_stop_str_in_output``; left out with ``drop_stop``, as a
    server may) or its token limit. ``rounds``: per call, each request's (prompt length, max tokens,
    stop)."""

    def __init__(self, tok, drop_stop: bool = False):
        self.tok, self.policy, self.drop_stop = tok, Policy(tok), drop_stop
        self.rounds: list[list[tuple[int, int, str | None]]] = []

    def __call__(self, prompts, max_tokens, stops):
        self.rounds.append(list(zip(map(len, prompts), max_tokens, stops)))
        return [self._one(list(p), n, s) for p, n, s in zip(prompts, max_tokens, stops)]

    def _one(self, ids, max_tokens, stop):
        t0, gen, hit = time.perf_counter(), [], False
        while len(gen) < max_tokens and not hit:
            gen.append(self.policy.next_token(ids + gen))
            hit = bool(stop) and stop in self.tok.decode(gen, skip_special_tokens=False)
            if gen[-1] == self.tok.eos_token_id:
                break
        if hit and self.drop_stop:
            gen = gen[: -len(self.tok.encode(stop, add_special_tokens=False))]
        now = time.perf_counter()
        return resubmit.Segment(gen, t0, now, now, evaluated=len(ids), stopped_on_string=hit)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(special_markers=True)


def _prompts(tok):
    return [build_prompt(tok, q, MarkerSpec.special_token(), "Answer.") for q in QUESTIONS]


def _run(tok, client, retriever, concurrency=2, max_new=64, **kw):
    return resubmit.run_resubmit("resubmit", client, tok, retriever, _prompts(tok), concurrency, max_new,
                                 **{**LOOP, **kw})


@pytest.mark.parametrize("drop_stop", [False, True])
def test_the_loop_answers_with_the_scripted_hops_in_lockstep_rounds(tok, drop_stop):
    client, retriever = PolicyClient(tok, drop_stop), ScriptedRetriever()
    r = _run(tok, client, retriever)
    assert r.answers == ANSWERS and r.finish == ["stop", "stop"]
    # one search call per round, holding the queries of every row that wrote a marker in it
    assert retriever.batches == [[QUERIES[0][0], QUERIES[1][0]], [QUERIES[0][1]]]
    assert [h.question for h in r.hops] == [0, 1, 0]
    assert all(h.ms >= 0 for h in r.hops)
    # rounds: both rows, both rows (after their first evidence), the first row alone
    assert [len(rnd) for rnd in client.rounds] == [2, 2, 1]
    assert all(stop == END for rnd in client.rounds for *_, stop in rnd)
    # a hop's evaluated tokens are what the client reported: here the whole re-tokenised prompt
    assert [h.evaluated for h in r.hops] == [client.rounds[1][0][0], client.rounds[1][1][0], client.rounds[2][0][0]]
    # "Release" was written letter by letter: the text tokenised again merges it, shifting every later id
    assert r.retokenized >= len("Release") and r.retokenized_hops >= 1
    # the token budget shrinks by what a row generated, its end marker included
    assert client.rounds[1][0][1] == 64 - _generated_in_round(tok, 0)
    assert r.wall_s > 0 and all(ms > 0 for ms in r.latency_ms)


def _generated_in_round(tok, question: int) -> int:
    """Tokens the policy writes for ``question`` up to and including its first end marker."""
    client = PolicyClient(tok)
    (seg,) = client([_prompts(tok)[question]], [64], [END])
    return len(seg.ids)


def test_one_row_at_a_time_searches_once_per_hop(tok):
    retriever = ScriptedRetriever()
    r = _run(tok, PolicyClient(tok), retriever, concurrency=1)
    assert r.answers == ANSWERS
    assert retriever.batches == [[QUERIES[0][0]], [QUERIES[0][1]], [QUERIES[1][0]]]


def test_past_the_hop_budget_the_stop_string_is_not_sent(tok):
    client, retriever = PolicyClient(tok), ScriptedRetriever()
    r = _run(tok, client, retriever, max_iterations=1)
    assert retriever.batches == [[QUERIES[0][0], QUERIES[1][0]]]
    assert [stop for *_, stop in client.rounds[1]] == [None, None]
    # the second marker gets no evidence: the policy ends the answer there
    assert r.answers == ["Release 4.2.1, approved by", "P1."] and r.finish == ["stop", "stop"]
    assert len(r.hops) == 2


def test_a_row_stops_at_its_token_budget(tok):
    r = _run(tok, PolicyClient(tok), ScriptedRetriever(), max_new=4)
    assert r.finish == ["length", "length"] and r.generated == [4, 4] and r.hops == []


def test_a_row_stops_when_the_context_is_full(tok):
    room = min(map(len, _prompts(tok))) + 1
    r = _run(tok, PolicyClient(tok), ScriptedRetriever(), context_limit=room)
    assert r.finish == ["context_full", "context_full"] and r.hops == []


def test_retokenization_mismatches_are_counted(tok):
    letters = [tok.encode(ch, add_special_tokens=False)[0] for ch in "Release"]
    merged = tok.encode("Release" + END + " more", add_special_tokens=False)
    assert merged[0] != letters[0] and len(merged) < len(letters) + 3
    assert resubmit.retokenization_mismatches(letters, merged) == len(letters)  # one merge shifts every later id
    same = tok.encode("Release", add_special_tokens=False)
    assert resubmit.retokenization_mismatches(same, tok.encode("Release" + END, add_special_tokens=False)) == 0
    assert resubmit.retokenization_mismatches([5, 6, 7], [5, 6]) == 1  # a position the new ids lack


def test_cut_at_the_token_that_completes_the_stop_string(tok):
    ids = tok.encode(f"a b{START}q{END} tail", add_special_tokens=False)
    cut, found = resubmit.cut_at(tok, ids, END)
    assert found and tok.decode(cut, skip_special_tokens=False).endswith(END)
    assert not tok.decode(cut[:-1], skip_special_tokens=False).endswith(END)
    assert resubmit.cut_at(tok, ids[:3], END) == (ids[:3], False)
    assert resubmit.cut_at(tok, [], END) == ([], False)


def test_llama_completer_reopens_a_connection_the_server_dropped(tok):
    prompt = build_prompt(tok, QUESTIONS[1], MarkerSpec.special_token(), "Answer.")
    with FakeLlamaServer(PolicyModel(Policy(tok), len(tok)), tok.eos_token_id, drop_connections=2) as server:
        complete = resubmit.LlamaCompleter(server.url, parallel=1)
        try:
            (seg,) = complete([prompt], [8], [END])
            assert seg.ids and len(server.requests) == 1  # two dropped, the third answered
            server.drop_connections = 3  # more than it retries: the error reaches the caller
            with pytest.raises(httpx.RemoteProtocolError):
                complete([prompt], [8], [END])
            assert len(server.requests) == 1
        finally:
            complete.close()
