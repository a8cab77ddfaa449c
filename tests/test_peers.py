"""``bench/peers.py`` on stand-ins (no vLLM, no llama-server, no real model): rig in process, rig and
the resubmit loop on the vLLM stand-in (``vllm_helpers``), rig and the resubmit loop on the
llama-server stand-in (``remote_helpers``), all over the tiny model steered by one scripted policy,
on 2 questions. Checks the JSON line's shape, that every system gives rig-hf's answers with the
scripted hops, that rig never re-tokenises and that the resubmit loop's re-tokenisation (a word the
"model" wrote letter by letter, which tokenising the text again merges) is counted."""

import io
import json

import pytest
import torch

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.servers import LlamaCppServer
from rig_decode.engine.runner_stream import StreamingRunner
from rig_decode.engine.runner_vllm import EventLoopThread, vllm_runner_on
from rig_decode.markers import MarkerSpec
from rig_decode.prompt import build_prompt

from .helpers import ScriptedRetriever, load_script, tiny_model, tiny_tokenizer
from .peers_helpers import ANSWERS, END, QUESTIONS, Policy, PolicyModel
from .remote_helpers import FakeLlamaServer
from .vllm_helpers import FakeAsyncLLM, fake_api

bench = load_script("bench/peers.py")
systems = load_script("bench/peers_systems.py")
report = load_script("bench/peers_report.py")
resubmit = load_script("bench/resubmit.py")

MAX_NEW = 64


pytestmark = pytest.mark.usefixtures("one_thread")


class RigPolicy:
    """The policy as an engine logits processor."""

    def __init__(self, policy):
        self.policy = policy

    def apply(self, rows, scores):
        for i, s in enumerate(rows):
            t = self.policy.next_token(s.token_ids)
            scores[i].fill_(float("-inf"))
            scores[i, t] = 0.0
        return scores


def vllm_policy_processor(policy):
    """The policy as a V1 logits processor of the vLLM stand-in (it sees the prompt and live output)."""

    class PolicyProcessor:
        def __init__(self, vllm_config, device, is_pin_memory):
            self.context = None

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            if batch_update is not None and batch_update.added:
                _, _, prompt, output = batch_update.added[0]
                self.context = (prompt, output)

        def apply(self, logits):
            prompt, output = self.context
            row = torch.full_like(logits, float("-inf"))
            row[:, self.policy_next(list(prompt) + list(output))] = 0.0
            return row

        policy_next = staticmethod(policy.next_token)

    return PolicyProcessor


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer(special_markers=True)
    return tok, tiny_model(len(tok)), Policy(tok), bench.SearchDelay(ScriptedRetriever(), 1.0)


def _rig_engine(tok, retriever, policy, c, model=None, runner=None):
    opts = EngineOptions(max_iterations=3, max_new_tokens=MAX_NEW, evidence_token_budget=96, top_k=2,
                         max_batch_size=c)
    return RigEngine(model, tok, retriever, opts, extra_processors=[RigPolicy(policy)], runner=runner)


def test_peers_on_stand_ins(setup):
    tok, model, policy, retriever = setup
    prompts = [build_prompt(tok, q, MarkerSpec.special_token(), "Answer.") for q in QUESTIONS]
    loop_kw = dict(max_iterations=3, top_k=2, evidence_budget=96, context_limit=2048)
    loop = EventLoopThread("test-peers")
    api = fake_api(model, tok.eos_token_id)
    fake_vllm = FakeAsyncLLM(model, tok.eos_token_id, logits_processors=[vllm_policy_processor(policy)])
    plans, alone_vllm = {}, FakeAsyncLLM(model, tok.eos_token_id)
    complete_vllm = resubmit.VllmCompleter(fake_vllm, api, loop)
    with FakeLlamaServer(PolicyModel(policy, len(tok)), tok.eos_token_id, slots=4) as server:
        complete_llama = resubmit.LlamaCompleter(server.url, parallel=2)
        peers = [
            systems.System("rig-hf", lambda p, c, n: systems.run_rig(
                "rig-hf", lambda c: _rig_engine(tok, retriever, policy, c, model=model), p, c, n)),
            systems.System("rig-vllm-stream", systems._recording(lambda p, c, n: systems.run_rig(
                "rig-vllm-stream", lambda c: _rig_engine(tok, retriever, policy, c, runner=vllm_runner_on(
                    FakeAsyncLLM(model, tok.eos_token_id, logits_processors=[vllm_policy_processor(policy)]), api,
                    len(tok), mode="stream", context_limit=2048, timeout_s=120)), p, c, n), plans)),
            systems.System("vllm-alone", lambda p, c, n: systems.run_alone(
                alone_vllm, api, loop, systems._plans_for(plans, p, c, n), c)),
            systems.System("rig-llama", lambda p, c, n: systems.run_rig(
                "rig-llama", lambda c: _rig_engine(tok, retriever, policy, c, runner=StreamingRunner(
                    LlamaCppServer(server.url), len(tok), top_logprobs=5)), p, c, n)),
            systems.System("resubmit-vllm", lambda p, c, n: resubmit.run_resubmit(
                "resubmit-vllm", complete_vllm, tok, retriever, p, c, n, **loop_kw)),
            systems.System("resubmit-llama", lambda p, c, n: resubmit.run_resubmit(
                "resubmit-llama", complete_llama, tok, retriever, p, c, n, **loop_kw)),
        ]
        runs, errors = bench.measure(peers, prompts, [1, 2], MAX_NEW, warmup=0)
        complete_llama.close()
    loop.close()
    assert not errors, errors
    summary = report.summarize(runs, [[a] for a in ANSWERS])
    result = report.result_json(summary, {"rig-vllm-prefix": "vLLM missing: stand-in test"}, {}, [1, 2],
                               questions=2, search_ms=1.0, model="tiny", dataset="stand-in", min_hops=0,
                               max_iterations=3, max_tokens=MAX_NEW)
    out = io.StringIO()
    report.print_report(result, out)
    print(json.dumps(result), file=out)
    lines = out.getvalue().strip().splitlines()
    data = json.loads(lines[-1])

    assert data["bench"] == "peers" and data["questions"] == 2 and data["search_ms"] == 1.0
    assert data["systems"]["rig-vllm-prefix"] == {"skipped": "vLLM missing: stand-in test"}
    assert any("rig-vllm-prefix" in line and "skipped" in line for line in lines[:-1])
    for key in ("ratios", "ratios_llama"):
        assert set(data[key]) == {"per_hop_c1", "per_hop_c2", "end_to_end_c1", "end_to_end_c2"}
        assert all(v > 0 for v in data[key].values()), data[key]
    for name in ("rig-hf", "rig-vllm-stream", "rig-llama", "resubmit-vllm", "resubmit-llama"):
        s = data["systems"][name]
        assert {"per_hop_ms", "hop_tokens_evaluated", "tok_s_c1", "tok_s_c2", "p95_ms", "retokenized",
                "same_answers"} <= set(s), (name, s)
        assert s["same_answers"] == s["same_answers_c2"] == "2/2", (name, s)
        assert s["hops"] == 3 and s["accuracy"] == 1.0, (name, s)
        assert s["per_hop_ms"] > 0 and s["tok_s_c1"] > 0 and s["tok_s_c2"] > 0 and s["p95_ms"] > 0
        assert s["hop_tokens_evaluated"] > 0
        if name.startswith("rig"):
            assert s["retokenized"] == 0 and s["retokenized_hops"] == 0
        else:  # "Release" was written letter by letter; the text tokenised again merges it
            assert s["retokenized"] > 0 and s["retokenized_hops"] >= 1, (name, s)
    assert runs["rig-hf"][1].answers == ANSWERS
    # vllm-alone replayed rig-vllm-stream's rows: the same tokens, each hop's chunk as rig sent it
    for c in (1, 2):
        alone, rig = runs["vllm-alone"][c], runs["rig-vllm-stream"][c]
        assert alone.generated == rig.generated and len(alone.hops) == len(rig.hops)
        assert sorted(h.evaluated for h in alone.hops) == sorted(h.evaluated for h in rig.hops)
        assert sum(alone.decode_tokens) == sum(rig.decode_tokens) > 0
    assert data["systems"]["vllm-alone"]["decode_tok_s_c1"] > 0 and set(data["decode_vs_alone"]) == {"c1", "c2"}
    # rig on vLLM's stand-in evaluates exactly what rig in process feeds: evidence + the marker token
    hf_hops = [(h.question, h.evaluated) for h in runs["rig-hf"][1].hops]
    assert [(h.question, h.evaluated) for h in runs["rig-vllm-stream"][1].hops] == hf_hops
    # the resubmit loop evaluates at least that much at every hop (the re-tokenised text, block-wise cache)
    for h, (_, rig_n) in zip(runs["resubmit-vllm"][1].hops, hf_hops):
        assert h.evaluated >= rig_n


def test_llama_slots_are_erased_before_a_run_or_the_log_says_why_not(setup, capsys):
    tok, model, policy, _ = setup
    prompt = build_prompt(tok, QUESTIONS[1], MarkerSpec.special_token(), "Answer.")
    for slot_actions in (True, False):
        with FakeLlamaServer(PolicyModel(policy, len(tok)), tok.eos_token_id, slots=2,
                             slot_actions=slot_actions) as server:
            complete = resubmit.LlamaCompleter(server.url, parallel=1)
            try:
                complete([prompt], [4], [END])
            finally:
                complete.close()
            assert sum(map(len, server.slots)) > 0
            systems.erase_llama_slots(server.url)()
            err = capsys.readouterr().err
            if slot_actions:
                assert server.slots == [[], []] and err == ""
            else:  # the server refuses: the run goes on with a warm cache, and the log says so
                assert sum(map(len, server.slots)) > 0
                assert "slots were not erased" in err and "501" in err and "--slot-save-path" in err


def test_rig_hops_are_the_traces_first_token_times():
    """``run_rig`` reads each hop's latency from the trace (``first_token_ms``) and leaves out a hop
    whose row finished at its marker; evaluated tokens are what llama-server reported, else the
    evidence plus the end-marker token."""
    from types import SimpleNamespace

    from rig_decode.trace import RetrievalStep, Trace

    steps = [[RetrievalStep(1, "a", evidence_tokens=40, first_token_ms=12.5),
              RetrievalStep(2, "b", evidence_tokens=30, first_token_ms=None)],
             [RetrievalStep(1, "c", evidence_tokens=50, first_token_ms=7.0, info={"server": {"prompt_n": 9}})]]

    class Engine:
        closed = False

        def new_sequence(self, prompt, seq_id, max_new_tokens):
            trace = Trace(retrieval_steps=steps[seq_id], generated_tokens=3, total_ms=20.0, queue_ms=5.0)
            return SimpleNamespace(seq_id=seq_id, trace=trace, finish_reason="stop", prompt_ids=list(prompt),
                                   token_ids=list(prompt),
                                   matcher=SimpleNamespace(visible_text=lambda: f" answer {seq_id} "))

        def generate(self, seqs):
            pass

        def close(self):
            Engine.closed = True

    r = systems.run_rig("rig-hf", lambda c: Engine(), [[1], [2]], 2, 8)
    assert [(h.question, h.ms, h.evaluated) for h in r.hops] == [(0, 12.5, 41), (1, 7.0, 9)]
    assert r.answers == ["answer 0", "answer 1"] and r.latency_ms == [15.0, 15.0] and Engine.closed


def test_repeated_runs_interleave_and_report_the_median_run():
    """``--repeat``: every round runs each concurrency of each system in turn (every other round in the
    reverse order); a system's figure is its median run's tokens/s with every run's hops pooled; rig
    vs the loop is also given run by run; a system that fails in a later round keeps the runs it had
    and does not stop the others."""
    order, walls = [], {"rig-llama": [4.0, 2.0, 1.0], "resubmit-llama": [2.0, 2.0, 2.0]}

    def system(name):
        def run(prompts, c, n):
            order.append((name, c))
            k = sum(1 for o in order if o == (name, c)) - 1
            if name == "rig-hf" and k == 1:
                raise RuntimeError("lost the engine")
            return report.RunResult(name, c, walls.get(name, [1.0] * 3)[k], ["a"], [8], [1.0],
                                    hops=[report.Hop(0, 100.0 * (k + 1), 5)])
        return systems.System(name, run)

    peers = [system("rig-hf"), system("rig-llama"), system("resubmit-llama")]
    runs, errors = bench.measure(peers, [[1]], [1, 2], 8, warmup=0, repeat=3)
    assert order[:6] == [(n, c) for c in (1, 2) for n in ("rig-hf", "rig-llama", "resubmit-llama")]
    assert order[6:9] == [(n, 1) for n in ("resubmit-llama", "rig-llama", "rig-hf")]  # round 2: reversed
    assert ("rig-hf", 2) not in order[9:]  # failed at its run 2: left out after
    assert errors == {"rig-hf": "RuntimeError: lost the engine"}
    assert set(runs["rig-hf"]) == {1, 2} and runs["rig-hf"][1].tok_s_runs is None  # round 1's runs kept
    rig = runs["rig-llama"][1]
    assert rig.tok_s == 4.0 and rig.tok_s_runs == [2.0, 4.0, 8.0]  # the median of 8 tokens in 4, 2, 1 s
    assert sorted(h.ms for h in rig.hops) == [100.0, 200.0, 300.0]
    summary = report.summarize(runs)
    assert summary["rig-llama"]["per_hop_ms_c1"] == 200.0 and summary["rig-llama"]["tok_s_c2_runs"] == [2.0, 4.0, 8.0]
    r = report.ratios(summary, [1, 2], "rig-llama", "resubmit-llama")
    assert r["end_to_end_c1"] == 1.0 and r["end_to_end_c1_runs"] == [0.5, 1.0, 2.0]
    out = io.StringIO()
    report.print_report(report.result_json(summary, {}, errors, [1, 2], questions=1, search_ms=0.0, model="m",
                                           dataset="d", min_hops=0, max_iterations=3, max_tokens=8), out)
    assert "tokens/s run by run: c1 0.5x 1x 2x; c2 0.5x 1x 2x" in out.getvalue()
