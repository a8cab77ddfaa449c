import json
import subprocess
import sys

import pytest

from rig_decode import RigConfig, RigSession
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ForceScript, ScriptedRetriever


def session(model, tok, script, **rig):
    cfg = RigConfig().updated(rig=rig, model={"max_tokens": 30})
    s = RigSession(cfg, model=model, tokenizer=tok, retriever=ScriptedRetriever())
    s.engine.processors.insert(0, ForceScript(script))
    return s


def test_ask_hides_markers_and_evidence(model, tok):
    m = MarkerVocab(tok, MarkerSpec.special_token()).marker_token_ids("E1234")
    s = session(model, tok, {0: {1: m}})
    answer, trace = s.ask("Which release fixed error E1234?")
    assert trace.num_hops == 1 and trace.retrieval_steps[0].query == "E1234"
    assert "<|retrieve|>" not in answer and "<evidence>" not in answer
    assert trace.question == "Which release fixed error E1234?"
    d = json.loads(trace.to_json())
    assert d["retrieval_steps"][0]["docs"][0]["id"] and d["num_hops"] == 1

    shown = session(model, tok, {0: {1: m}}, show_markers=True)
    answer, _ = shown.ask("Which release fixed error E1234?")
    assert "<|retrieve|>E1234<|endofretrieve|>" in answer and "<evidence>" in answer


def test_ask_batch_and_messages(model, tok):
    s = session(model, tok, {})
    out = s.ask_batch(["one", [{"role": "user", "content": "two"}]])
    assert len(out) == 2 and all(t.finish_reason for _, t in out)


@pytest.mark.parametrize("bad", ["", "   ", [], [{"role": "user"}]])
def test_bad_questions(model, tok, bad):
    with pytest.raises(ValueError):
        session(model, tok, {}).ask(bad)


@pytest.mark.real_model
def test_cli_ask_json_on_the_default_model(real):
    out = subprocess.run(
        [sys.executable, "-m", "rig_decode.cli", "ask", "Who founded the company that makes the Brisa T4?",
         "--json", "--max-tokens", "48"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert isinstance(d["answer"], str)
    t = d["trace"]
    for key in ("retrieval_steps", "prompt_tokens", "generated_tokens", "evidence_tokens", "ttft_ms",
                "decode_ms", "retrieval_ms", "splice_ms", "finish_reason"):
        assert key in t
    assert t["generated_tokens"] == 48 or t["finish_reason"] == "stop"
    for step in t["retrieval_steps"]:
        assert {"round", "query", "docs", "latency_ms", "evidence_tokens"} <= set(step)


@pytest.mark.real_model
def test_demo_questions_take_visible_hops_on_their_own(real):
    """The README demo: the default model with its shipped marker adapter decides by itself (no
    forced first hop) to search once per hop of each multi-hop question, starting with the
    question's product, and answers every question right."""
    from importlib import resources

    questions = json.loads((resources.files("rig_decode") / "data" / "demo_questions.json").read_text())
    session = RigSession()
    assert not session.config.rig.retrieve_first
    results = session.ask_batch([q["question"] for q in questions])
    for q, (answer, trace) in zip(questions, results):
        queries = [s.query for s in trace.retrieval_steps]
        assert len(queries) == q["hops"], (q["question"], queries)
        assert q["entity"] in queries[0], (q["entity"], queries)
        assert q["answer"] in answer, (q["question"], answer)


def test_cli_reports_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rig: {hops: 3}\n")
    out = subprocess.run([sys.executable, "-m", "rig_decode.cli", "ask", "hi", "--config", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "rig.hops: unknown key" in out.stderr
