"""``bench/peers.py`` on stand-ins (no vLLM, no llama-server, no real model): rig in process, rig and
the resubmit loop on the vLLM stand-in (``vllm_helpers``), rig and the resubmit loop on the
llama-server stand-in (``remote_helpers``), all over the tiny model steered by one scripted policy,
on 2 questions. Checks the JSON line's shape, that every system gives rig-hf's answers with the
scripted hops, that rig never re-tokenises and that the resubmit loop's re-tokenisation (a word the
"model" wrote letter by letter, which tokenising the text again merges) is counted."""

import io
import json
import re

import httpx
import pytest
import torch

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.runner_remote import LlamaCppServer, RemoteRunner
from rig_decode.engine.runner_vllm import EventLoopThread, VllmRunner
from rig_decode.markers import MarkerSpec
from rig_decode.prompt import build_prompt

from .helpers import ScriptedRetriever, load_script, tiny_model, tiny_tokenizer
from .remote_helpers import FakeLlamaServer
from .vllm_helpers import FakeAsyncLLM, fake_api

bench = load_script("bench/peers.py")

START, END = "<|retrieve|>", "<|endofretrieve|>"
QUESTIONS = ["Which release fixed error E1234?", "What priority does data loss get?"]
SCRIPTS = {  # what the "model" writes, piece by piece; True: letter by letter (one token per letter)
    QUESTIONS[0]: [("Release", True), (f"{START}error E1234 fixed{END}", False), (" 4.2.1, approved by", False),
                   (f"{START}release 4.2.1 approved by{END}", False), (" Priya Raman.", False)],
    QUESTIONS[1]: [(f"{START}data loss priority{END}", False), (" P1.", False)],
}
ANSWERS = ["Release 4.2.1, approved by Priya Raman.", "P1."]
MAX_NEW = 64


pytestmark = pytest.mark.usefixtures("one_thread")


class Policy:
    """The next token as a function of the text so far: the question's script continued from what
    was written (evidence blocks left out); EOS at its end, and after an end marker no evidence
    followed (an engine that ignores the stop string stops there)."""

    def __init__(self, tok):
        self.tok, self.eos = tok, tok.eos_token_id

    def next_token(self, ids) -> int:
        text = self.tok.decode(list(ids), skip_special_tokens=False)
        question = next(q for q in SCRIPTS if q in text)
        written = text[text.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
        if END in written and written.rfind("</evidence>") < written.rfind(END):
            return self.eos
        written = re.sub(r"\n<evidence>\n.*?</evidence>\n", "", written, flags=re.S)
        pos = 0
        for piece, spelled in SCRIPTS[question]:
            if len(written) < pos + len(piece):
                off = len(written) - pos
                if written[pos:] != piece[:off]:
                    return self.eos
                rest = piece[off:]
                return self.tok.encode(rest[0] if spelled else rest, add_special_tokens=False)[0]
            if written[pos : pos + len(piece)] != piece:
                return self.eos
            pos += len(piece)
        return self.eos


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


class PolicyModel:
    """The policy as a cache-free model for the llama-server stand-in."""

    def __init__(self, policy, vocab_size):
        self.policy, self.vocab_size = policy, vocab_size

    def __call__(self, input_ids):
        logits = torch.full((1, input_ids.shape[1], self.vocab_size), -30.0)
        logits[0, -1, self.policy.next_token(input_ids[0].tolist())] = 0.0
        return type("Out", (), {"logits": logits})()


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
    complete_vllm = bench.VllmCompleter(fake_vllm, api, loop)
    with FakeLlamaServer(PolicyModel(policy, len(tok)), tok.eos_token_id, slots=4) as server:
        complete_llama = bench.LlamaCompleter(server.url, parallel=2)
        systems = [
            bench.System("rig-hf", lambda p, c, n: bench.run_rig(
                "rig-hf", lambda c: _rig_engine(tok, retriever, policy, c, model=model), p, c, n)),
            bench.System("rig-vllm-stream", lambda p, c, n: bench.run_rig(
                "rig-vllm-stream", lambda c: _rig_engine(tok, retriever, policy, c, runner=VllmRunner(
                    FakeAsyncLLM(model, tok.eos_token_id), api, len(tok), mode="stream", context_limit=2048,
                    timeout_s=120)), p, c, n)),
            bench.System("rig-llama", lambda p, c, n: bench.run_rig(
                "rig-llama", lambda c: _rig_engine(tok, retriever, policy, c, runner=RemoteRunner(
                    LlamaCppServer(server.url), len(tok), lookahead=4, top_logprobs=5, parallel=c)), p, c, n)),
            bench.System("resubmit-vllm", lambda p, c, n: bench.run_resubmit(
                "resubmit-vllm", complete_vllm, tok, retriever, p, c, n, **loop_kw)),
            bench.System("resubmit-llama", lambda p, c, n: bench.run_resubmit(
                "resubmit-llama", complete_llama, tok, retriever, p, c, n, **loop_kw)),
        ]
        runs, errors = bench.measure(systems, prompts, [1, 2], MAX_NEW, warmup=0)
        complete_llama.close()
    loop.close()
    assert not errors, errors
    summary = bench.summarize(runs, [[a] for a in ANSWERS])
    result = bench.result_json(summary, {"rig-vllm-prefix": "vLLM missing: stand-in test"}, {}, [1, 2],
                               questions=2, search_ms=1.0, model="tiny", dataset="stand-in", min_hops=0,
                               max_iterations=3, max_tokens=MAX_NEW)
    out = io.StringIO()
    bench.print_report(result, out)
    print(json.dumps(result), file=out)
    lines = out.getvalue().strip().splitlines()
    data = json.loads(lines[-1])

    assert data["bench"] == "peers" and data["questions"] == 2 and data["search_ms"] == 1.0
    assert data["systems"]["rig-vllm-prefix"] == {"skipped": "vLLM missing: stand-in test"}
    assert any("rig-vllm-prefix" in line and "skipped" in line for line in lines[:-1])
    assert set(data["ratios"]) == {"per_hop_c1", "per_hop_c2", "end_to_end_c2"}
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
    # rig on vLLM's stand-in evaluates exactly what rig in process feeds: evidence + the marker token
    hf_hops = [(h.question, h.evaluated) for h in runs["rig-hf"][1].hops]
    assert [(h.question, h.evaluated) for h in runs["rig-vllm-stream"][1].hops] == hf_hops
    # the resubmit loop evaluates at least that much at every hop (the re-tokenised text, block-wise cache)
    for h, (_, rig_n) in zip(runs["resubmit-vllm"][1].hops, hf_hops):
        assert h.evaluated >= rig_n


def test_llama_completer_reopens_a_connection_the_server_dropped(setup):
    tok, model, policy, _ = setup
    prompt = build_prompt(tok, QUESTIONS[1], MarkerSpec.special_token(), "Answer.")
    with FakeLlamaServer(PolicyModel(policy, len(tok)), tok.eos_token_id, drop_connections=2) as server:
        complete = bench.LlamaCompleter(server.url, parallel=1)
        try:
            (seg,) = complete([prompt], [8], [END])
            assert seg.ids and len(server.requests) == 1  # two dropped, the third answered
            server.drop_connections = 3  # more than it retries: the error reaches the caller
            with pytest.raises(httpx.RemoteProtocolError):
                complete([prompt], [8], [END])
            assert len(server.requests) == 1
        finally:
            complete.close()


def test_llama_slots_are_erased_before_a_run_or_the_log_says_why_not(setup, capsys):
    tok, model, policy, _ = setup
    prompt = build_prompt(tok, QUESTIONS[1], MarkerSpec.special_token(), "Answer.")
    for slot_actions in (True, False):
        with FakeLlamaServer(PolicyModel(policy, len(tok)), tok.eos_token_id, slots=2,
                             slot_actions=slot_actions) as server:
            complete = bench.LlamaCompleter(server.url, parallel=1)
            try:
                complete([prompt], [4], [END])
            finally:
                complete.close()
            assert sum(map(len, server.slots)) > 0
            bench._erase_llama_slots(server.url)()
            err = capsys.readouterr().err
            if slot_actions:
                assert server.slots == [[], []] and err == ""
            else:  # the server refuses: the run goes on with a warm cache, and the log says so
                assert sum(map(len, server.slots)) > 0
                assert "slots were not erased" in err and "501" in err and "--slot-save-path" in err


def test_retokenization_mismatches_are_counted():
    tok = tiny_tokenizer(special_markers=True)
    letters = [tok.encode(ch, add_special_tokens=False)[0] for ch in "Release"]
    merged = tok.encode("Release" + END + " more", add_special_tokens=False)
    assert merged[0] != letters[0] and len(merged) < len(letters) + 3
    assert bench.retokenization_mismatches(letters, merged) == len(letters)  # one merge shifts every later id
    same = tok.encode("Release", add_special_tokens=False)
    assert bench.retokenization_mismatches(same, tok.encode("Release" + END, add_special_tokens=False)) == 0
    ids = tok.encode(f"a b{START}q{END} tail", add_special_tokens=False)
    cut, found = bench.cut_at(tok, ids, END)
    assert found and tok.decode(cut, skip_special_tokens=False).endswith(END)
    assert bench.cut_at(tok, ids[:3], END) == (ids[:3], False)
