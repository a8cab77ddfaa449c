"""The streaming remote runner (its exactness: ``tests/test_remote.py``, for both remote runners): one
server request per stretch between hops (not per token, not per lookahead window), the stream closed
while a row searches, a slot kept per row, faults kept to their row."""

import time

import pytest
import torch

from rig_decode.engine.servers import LlamaCppServer
from rig_decode.engine.runner_remote import RemoteRunner
from rig_decode.engine.runner_stream import SCORED_LEAD, StreamingRunner, StreamRow
from rig_decode.engine.sampling import PickRule
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.prompt import build_prompt

from .helpers import ScriptedRetriever, tiny_model, tiny_tokenizer
from .peers_helpers import ANSWERS, END, QUESTIONS, START, Policy, PolicyModel
from .remote_helpers import FakeLlamaServer
from .test_exactness import PROMPTS, _script
from .test_remote import _engine, _generate, plain_answers


def test_one_request_streams_a_whole_answer(model, tok):
    """With nothing forced and a server no faster than the engine takes its tokens, the answer is one
    request however long (the lookahead runner: one per window)."""
    with FakeLlamaServer(model, tok.eos_token_id, token_delay_s=0.05) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok))
        seq, ref = plain_answers(model, tok, runner)
    assert seq.token_ids == ref.token_ids and seq.num_generated == 40
    assert runner.calls == 1 and len(server.requests) == 1


def test_a_hop_costs_one_request_and_the_stream_stops_while_the_row_searches(tok_special):
    model = tiny_model(len(tok_special))
    vocab = MarkerVocab(tok_special, MarkerSpec.special_token())
    script = {0: {3: vocab.marker_token_ids("error E1234 fixed in release"),
                  20: vocab.marker_token_ids("who approved it")}}
    with FakeLlamaServer(model, tok_special.eos_token_id) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok_special))
        engine = _engine(model, tok_special, script, runner=runner, max_new_tokens=40)
        engine.retriever.delay_s = 0.3  # a slow search: time for a stream to run on
        assert runner.stop_after == {tok_special.convert_tokens_to_ids("<|endofretrieve|>"), *engine.stop_ids}
        seq = _generate(engine, tok_special, PROMPTS[:1])[0]
        local = _generate(_engine(model, tok_special, script, max_new_tokens=40), tok_special, PROMPTS[:1])[0]
        assert seq.token_ids == local.token_ids and seq.trace.num_hops == 2
        # a token the script forces off the model's path costs a request; a hop costs one
        forced = sum(len(ids) for ids in script[0].values())
        assert runner.calls <= 1 + forced + seq.trace.num_hops
        # and each stream stopped when its row parked or diverged, within a few tokens (its socket shut
        # down: the server's next sends fail), not at the end of the context
        time.sleep(0.5)
        assert server.decoded <= seq.num_generated + 5 * runner.calls, (server.decoded, seq.num_generated, runner.calls)



def test_the_server_stops_at_the_end_marker_it_writes_itself():
    """A model that writes its own markers: each stream asks the server to stop at the end
    delimiter's text, so the server decodes exactly the tokens the engine takes (a closed connection
    alone would let it decode on until a send failed: here, the EOS that follows an unanswered marker)."""
    tok = tiny_tokenizer(special_markers=True)
    policy = Policy(tok)
    prompts = [build_prompt(tok, q, MarkerSpec.special_token(), "Answer.") for q in QUESTIONS]
    text = {i: tok.decode([i], skip_special_tokens=False) for i in range(len(tok))}
    with FakeLlamaServer(PolicyModel(policy, len(tok)), tok.eos_token_id, token_text=text.__getitem__) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok))
        opts = EngineOptions(max_iterations=3, max_new_tokens=64, evidence_token_budget=96, top_k=2)
        engine = RigEngine(None, tok, ScriptedRetriever(), opts, runner=runner)
        seqs = [engine.new_sequence(p, seq_id=i) for i, p in enumerate(prompts)]
        engine.generate(seqs)
        engine.close()
    assert [s.matcher.visible_text().strip() for s in seqs] == ANSWERS
    assert runner.stop_text == (END,) and runner.opens_query_text == (START,)
    assert all(r["stop"] == ([END] if r["n_probs"] else [END, START]) for r in server.requests)
    # a row's first stretch (no query seen yet) streams without scores (the rules there are bans: the
    # stray end delimiter's) and stops at its query's start, whose tokens come with scores (the
    # newline rule needs them) in a second request; those queries opened within SCORED_LEAD tokens of
    # their stretch's start, so each stream after evidence asks for scores from its start and runs on
    # into the next query: a hop costs one request
    hops = sum(s.trace.num_hops for s in seqs)
    assert runner.lead <= SCORED_LEAD
    assert runner.calls == len(server.requests) == 2 * len(seqs) + hops == 7
    unscored = [r for r in server.requests if not r["n_probs"]]
    end = tok.convert_tokens_to_ids(END)
    assert len(unscored) == len(seqs) and all(r["banned"] == [end] for r in unscored)
    assert all(r["n_probs"] == 20 and r["banned"] == [] for r in server.requests if r not in unscored)
    assert server.decoded == sum(s.num_generated for s in seqs)


class _NoSlots:
    def total_slots(self):
        return None

    def context_limit(self):
        return None


def test_a_stream_asks_for_scores_from_its_start_where_queries_open_soon():
    """Where the last query opened within SCORED_LEAD tokens of its stretch's start, a stream that may
    open a query asks for scores from its start (the query then needs no request of its own); where it
    opened later, or the hop budget is spent (the bans hold the query's start), the bans go up."""
    runner = StreamingRunner(_NoSlots(), 100)
    runner.opens_query = frozenset({7})
    bans, spent = frozenset({9}), frozenset({7, 9})

    def feed(row, ids, rules=bans):
        runner._track(row, ids)
        row.tokens += ids
        return runner._rules(None if rules is None else PickRule(rules))

    row = StreamRow([])
    assert feed(row, [1, 2, 3]) == bans  # a prompt, no query seen yet
    for t in range(SCORED_LEAD + 1):
        assert feed(row, [10 + t]) == bans
    feed(row, [7], None)
    assert runner.lead == SCORED_LEAD + 1  # opened its query too late: the next stretch sends bans
    assert feed(row, [8, 4, 4, 4]) == bans  # end marker and evidence
    feed(row, [7], None)
    assert runner.lead == 0
    other = StreamRow([])
    assert feed(other, [1, 2]) is None  # any row now: scores, from its prompt on
    assert feed(other, [5], spent) == spent  # no query can open: the bans still go up


def test_the_batch_is_held_to_the_servers_slots(model, tok):
    """A stream holds its slot while it lives: three rows on a two-slot server decode two at a time,
    and all three get the in-process tokens."""
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _generate(_engine(model, tok, script, max_new_tokens=40), tok, PROMPTS)
    with FakeLlamaServer(model, tok.eos_token_id, slots=2) as server:
        engine = _engine(model, tok, script, runner=StreamingRunner(LlamaCppServer(server.url), len(tok)),
                         max_new_tokens=40)
        assert engine.opts.max_batch_size == 2
        remote = _generate(engine, tok, PROMPTS)
    assert [s.token_ids for s in remote] == [s.token_ids for s in local]
    assert {r["slot"] for r in server.requests} == {0, 1}


def test_each_row_keeps_its_slot(model, tok):
    with FakeLlamaServer(model, tok.eos_token_id, slots=4) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok))
        script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
        seqs = _generate(_engine(model, tok, script, runner=runner, max_new_tokens=40), tok, PROMPTS)
        by_prompt = {}
        for r in server.requests:
            by_prompt.setdefault(r["slot"], []).append(r["prompt_len"])
    assert len(by_prompt) == len(seqs)  # three rows, three slots, each row's requests on its own
    for lengths in by_prompt.values():
        assert lengths == sorted(lengths)  # one row's requests, its context growing
    assert runner.free_slots == [0, 1, 2, 3]  # given back when the rows ended


@pytest.mark.parametrize("streaming", [True, False])
def test_a_request_the_server_closed_unanswered_goes_once_more(model, tok, streaming):
    """llama-server closes a kept-alive connection after a stream read to its end, and a request
    sent on it meanwhile gets no answer at all ("Server disconnected without sending a response").
    The server never saw such a request: it goes once more on a new connection, and no row fails."""
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _generate(_engine(model, tok, script, max_new_tokens=40), tok, PROMPTS)
    with FakeLlamaServer(model, tok.eos_token_id, drop_connections=1) as server:
        server_api = LlamaCppServer(server.url)
        runner = (StreamingRunner(server_api, len(tok), timeout_s=10) if streaming
                  else RemoteRunner(server_api, len(tok), lookahead=8))
        remote = _generate(_engine(model, tok, script, runner=runner, max_new_tokens=40), tok, PROMPTS)
        assert server.drop_connections == 0  # it dropped one
    assert [(s.token_ids, s.finish_reason) for s in remote] == [(s.token_ids, s.finish_reason) for s in local]


def test_a_dropped_stream_or_garbage_fails_that_row_alone(model, tok):
    """A request the server drops (and drops again when it goes once more), or answers with garbage
    (not JSON; a token id no tokenizer has), ends its row with an engine error naming the server (or
    the token); the other rows of the batch finish as the in-process engine finishes them."""
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _generate(_engine(model, tok, script, max_new_tokens=40), tok, PROMPTS)
    for fault in ({"drop_connections": 2, "drop_slot": 0}, {"garbage": 1}, {"bad_ids": 1}):
        with FakeLlamaServer(model, tok.eos_token_id, **fault) as server:
            runner = StreamingRunner(LlamaCppServer(server.url), len(tok), timeout_s=10)
            remote = _generate(_engine(model, tok, script, runner=runner, max_new_tokens=40), tok, PROMPTS)
        failed = [s for s in remote if s.finish_reason == "error"]
        error = failed[0].trace.engine_errors[0] if len(failed) == 1 else None
        assert error and (server.url in error or "token id -5" in error), (fault, error)
        for a, b in zip(local, remote):
            assert b is failed[0] or (b.token_ids == a.token_ids and b.finish_reason == a.finish_reason)


def test_rig_serve_on_the_remote_backend_answers_the_openai_client(model, tok):
    """``rig serve --backend remote``: plain and streaming (with hop events) through the official client."""
    pytest.importorskip("openai")
    from rig_decode import RigConfig, RigSession
    from rig_decode.server import create_app

    from .helpers import ScriptedRetriever
    from .server_helpers import ask_plain_and_streamed, serve

    question = "Which release fixed error E1234 and who approved it?"
    cfg = RigConfig().updated(model={"max_tokens": 30, "adapter": None},
                              rig={"retrieve_first": True, "max_query_tokens": 8})
    local_answer, _ = RigSession(cfg, model=model, tokenizer=tok, retriever=ScriptedRetriever()).ask(question)
    with FakeLlamaServer(model, tok.eos_token_id) as llama:
        remote = cfg.updated(engine={"backend": "remote", "remote": {"base_url": llama.url}})
        session = RigSession(remote, tokenizer=tok, retriever=ScriptedRetriever())
        with serve(create_app(remote.updated(server={"model_name": "tiny"}), engine=session.engine)) as base:
            plain, text, hops = ask_plain_and_streamed(base, "tiny", question)
        session.close()
    assert plain.choices[0].message.content == text == local_answer
    assert len(hops) == plain.model_extra["rig"]["num_hops"] == 1
    assert [h["query"] for h in plain.model_extra["rig"]["hops"]] == hops
    assert all(r["stream"] for r in llama.requests)


def test_an_openai_server_stream_is_read_as_vllm_writes_it():
    """vLLM's streamed /v1/completions (its serving code's chunk shapes): token ids per chunk, top
    log-probabilities keyed ``token_id:N``, the cached prompt tokens on the final usage chunk."""
    import json

    import httpx

    from rig_decode.engine.servers import OpenAICompletionServer

    chunks = [{"choices": [{"index": 0, "text": "", "token_ids": [5],
                            "logprobs": {"top_logprobs": [{"token_id:5": -0.1, "token_id:7": -2.5}]}}]},
              {"choices": [{"index": 0, "text": "", "token_ids": [7, 9],
                            "logprobs": {"top_logprobs": [{"token_id:7": -0.2}, {"token_id:9": -0.3,
                                                                                 "token_id:2": -1.0}]}}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}]
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    server = OpenAICompletionServer("http://vllm", model="m")
    server.http = httpx.Client(base_url="http://vllm", transport=httpx.MockTransport(handler))
    events = list(server.stream_completion([1, 2, 3], 10, 2))
    preds = [p for ps, _ in events for p in ps]
    assert [p.token for p in preds] == [5, 7, 9]
    assert preds[0].top == [(5, -0.1), (7, -2.5)] and preds[2].top == [(9, -0.3), (2, -1.0)]
    assert [info for _, info in events if info] == [{"cache_n": 2, "prompt_n": 1}]
    body = seen[0]
    assert body["prompt"] == [1, 2, 3] and body["stream"] and body["return_token_ids"] and body["logprobs"] == 2


class _RowCounter:
    """A processor that bans nothing and counts the rows it is applied to."""

    def __init__(self):
        self.rows = 0

    def apply(self, rows, scores):
        self.rows += len(rows)
        return scores

    def fixed_bans(self, row):
        return frozenset()


@pytest.mark.parametrize("hops,honour", [(0, True), (1, True), (0, False)])
def test_the_server_applies_the_bans_and_picks_the_in_process_tokens(tok_special, hops, honour):
    """Outside a query the rules only ban tokens: the stream asks the server to apply them
    (``logit_bias``) and sends no scores. A model that prefers the banned tokens (its head writes the
    start delimiter where it would write its favourite token, the end delimiter where its second)
    still gets the in-process engine's tokens: past the hop budget the server picks the runner-up. A
    server that ignores the bans costs a request per banned pick (that position asked again with
    scores), not a wrong token."""
    model = tiny_model(len(tok_special))
    start, end = (tok_special.convert_tokens_to_ids(t) for t in (START, END))
    plain = _generate(_engine(model, tok_special, {}, max_iterations=0, max_new_tokens=40), tok_special, PROMPTS)
    counts = torch.bincount(torch.tensor([t for s in plain for t in s.token_ids[len(s.prompt_ids):]]))
    first, second = counts.topk(2).indices.tolist()
    with torch.no_grad():  # a head that scores the markers above those two wherever they lead
        model.lm_head.weight[start] = 1.5 * model.lm_head.weight[first]
        model.lm_head.weight[end] = 1.5 * model.lm_head.weight[second]
    opts = {"max_iterations": hops, "max_new_tokens": 40, "max_query_tokens": 4}
    local = _generate(_engine(model, tok_special, {}, **opts), tok_special, PROMPTS)
    seen = _RowCounter()
    with FakeLlamaServer(model, tok_special.eos_token_id, honour_bans=honour) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok_special))
        engine = _engine(model, tok_special, {}, runner=runner, **opts)
        engine.processors.insert(0, seen)
        remote = _generate(engine, tok_special, PROMPTS)
    assert [s.token_ids for s in remote] == [s.token_ids for s in local]
    sampled = sum(s.num_generated for s in remote)
    # the engine runs its processors only where the server's token does not settle the pick: not on
    # its picks under the bans, nor on a query's tokens that outweigh the newline rule's pool; where
    # a server that ignores bans picked a banned token, they do
    assert seen.rows < sampled and (seen.rows > 0 or honour)
    assert max(s.trace.num_hops for s in remote) == hops  # it opened the hop it could
    if not honour:
        assert len(server.requests) > 10 * len(PROMPTS) and any(r["n_probs"] for r in server.requests)
        return
    unscored = [r for r in server.requests if not r["n_probs"]]
    assert server.overruled > 0 and unscored  # the bans changed the server's picks
    assert all(end in r["banned"] for r in unscored)  # a stray end delimiter, everywhere outside a query
    # the start delimiter once the budget is spent: from the first token (0 hops), after the hop (1)
    assert any(start in r["banned"] for r in unscored)
    assert any(start not in r["banned"] for r in unscored) == (hops > 0)
    assert all(r["n_probs"] == 20 for r in server.requests if r not in unscored)



class _ScoredOnly(StreamingRunner):
    pushes_bans = False  # every stream sends scores (as vLLM's chunks do)


@pytest.mark.parametrize("hops", [0, 1])
def test_a_scored_token_the_bans_allow_is_taken_without_the_processors(tok_special, hops):
    """A stream that sends scores still spares the engine its processors where the rules at a position
    only ban tokens: a greedy token they do not ban is the engine's pick (``take_picks``). The
    processors run inside queries and where the server's token is banned (the start delimiter past
    the budget, which this model prefers), and the tokens are the in-process engine's."""
    model = tiny_model(len(tok_special))
    start = tok_special.convert_tokens_to_ids(START)
    plain = _generate(_engine(model, tok_special, {}, max_iterations=0, max_new_tokens=40), tok_special, PROMPTS)
    counts = torch.bincount(torch.tensor([t for s in plain for t in s.token_ids[len(s.prompt_ids):]]))
    with torch.no_grad():  # the start delimiter wherever the favourite token leads
        model.lm_head.weight[start] = 1.5 * model.lm_head.weight[int(counts.argmax())]
    opts = {"max_iterations": hops, "max_new_tokens": 40, "max_query_tokens": 4}
    local = _generate(_engine(model, tok_special, {}, **opts), tok_special, PROMPTS)
    seen = _RowCounter()
    with FakeLlamaServer(model, tok_special.eos_token_id) as server:
        runner = _ScoredOnly(LlamaCppServer(server.url), len(tok_special))
        engine = _engine(model, tok_special, {}, runner=runner, **opts)
        engine.processors.insert(0, seen)
        remote = _generate(engine, tok_special, PROMPTS)
    assert [s.token_ids for s in remote] == [s.token_ids for s in local]
    assert all(r["n_probs"] == 20 and not r["banned"] for r in server.requests)
    sampled = sum(s.num_generated for s in remote)
    assert 0 < seen.rows < sampled / 2, (seen.rows, sampled)
    assert max(s.trace.num_hops for s in remote) == hops


def test_a_partial_step_answers_the_rows_whose_tokens_came(model, tok):
    """A row whose first token is slow (a long prefill) holds up no other row: a partial step answers
    the rows whose predictions have come, and the slow row, fed the same tokens again at the next
    step, is not sent again; it is answered once its token comes, with the server's greedy token."""
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    with FakeLlamaServer(model, tok.eos_token_id, slow_slots={0: 1.0}) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok))
        feeds = runner.add_rows(prompts)
        logits = runner.step(feeds, partial=True, max_wait_s=5)
        assert runner.take_answered() == [1]
        for _ in range(3):
            logits = runner.step([prompts[0], [int(logits[1].argmax())]], partial=True, max_wait_s=5)
            assert runner.take_answered() == [1]
        assert len(server.requests) == 2  # one stream per row, the slow one not asked twice
        with pytest.raises(ValueError, match="waits for its prediction"):
            runner.step([prompts[0][:-1], []], partial=True)
        t0 = time.perf_counter()
        assert runner.step([prompts[0], []], partial=True, max_wait_s=0.05) is not None
        assert runner.take_answered() == [] and time.perf_counter() - t0 < 0.5  # nothing yet: back soon
        logits = runner.step([prompts[0], []], partial=True, max_wait_s=5)
        assert runner.take_answered() == [0]
        with torch.no_grad():
            expected = int(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1].argmax())
        assert int(logits[0].argmax()) == expected
        runner.close()


def test_a_slow_row_holds_up_neither_the_others_tokens_nor_their_searches(tok_special, monkeypatch):
    """In the engine: while one row's first token is slow to come, the other decodes, parks for its
    search, and its evidence goes up as soon as the search returns (the result wakes the waiting
    step); it finishes before the slow row's first token, and both rows are the in-process tokens."""
    from rig_decode.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "PARTIAL_WAIT_S", 30.0)  # only a token or a search result ends a wait
    model = tiny_model(len(tok_special))
    vocab = MarkerVocab(tok_special, MarkerSpec.special_token())
    script = {1: {3: vocab.marker_token_ids("who approved it")}}
    local = _generate(_engine(model, tok_special, script, max_new_tokens=30), tok_special, PROMPTS[:2])
    with FakeLlamaServer(model, tok_special.eos_token_id, slow_slots={0: 2.0}) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok_special), timeout_s=10)
        engine = _engine(model, tok_special, script, runner=runner, max_new_tokens=30)
        engine.retriever.delay_s = 0.2
        slow, fast = _generate(engine, tok_special, PROMPTS[:2])
    assert [slow.token_ids, fast.token_ids] == [local[0].token_ids, local[1].token_ids]
    assert fast.trace.num_hops == 1 and fast.trace.total_ms < 1500 < slow.trace.ttft_ms, \
        (fast.trace.total_ms, slow.trace.ttft_ms)


def test_a_bad_token_id_fails_its_row_where_the_engine_takes_the_servers_pick(model, tok):
    """Where the rules let the engine take the server's greedy token as it is (no processors, no
    scores written), a token id no tokenizer has, in the pick or in its top list, still ends that
    row with an engine error naming it; the other rows finish as in process."""
    local = _generate(_engine(model, tok, {}, max_new_tokens=40), tok, PROMPTS)
    with FakeLlamaServer(model, tok.eos_token_id, bad_ids=1) as server:
        runner = StreamingRunner(LlamaCppServer(server.url), len(tok), timeout_s=10)
        remote = _generate(_engine(model, tok, {}, runner=runner, max_new_tokens=40), tok, PROMPTS)
    failed = [s for s in remote if s.finish_reason == "error"]
    assert len(failed) == 1 and "token id -5" in failed[0].trace.engine_errors[0]
    for a, b in zip(local, remote):
        assert b is failed[0] or (b.token_ids == a.token_ids and b.finish_reason == a.finish_reason)
