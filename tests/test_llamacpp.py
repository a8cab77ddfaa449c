"""The remote backend against a real llama.cpp ``llama-server`` serving the embedded default model.

``scripts/test.sh`` builds ``llama-server`` (``scripts/build_llama.sh``, cached under build/) and sets
``RIG_LLAMA_SERVER`` to it and ``RIG_LLAMA_CONVERT`` to llama.cpp's ``convert_hf_to_gguf.py``;
without them the module is skipped. The model is converted
to an F32 GGUF from the same safetensors the in-process backend loads, so both compute with the
same weights in float32. The test starts and stops the server itself.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SERVER, CONVERT = os.environ.get("RIG_LLAMA_SERVER"), os.environ.get("RIG_LLAMA_CONVERT")
pytestmark = [pytest.mark.llamacpp,
              pytest.mark.skipif(not (SERVER and CONVERT), reason="set RIG_LLAMA_SERVER and RIG_LLAMA_CONVERT")]

QUESTIONS = ["Who founded the company that makes the Brisa T4?",
             "In which city is the company that makes the Lumora K7 headquartered?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(gguf: Path, slots: int = 4, ctx: int = 8192):
    """llama-server on ``gguf`` at a free port: yields its URL, stops it after."""
    import httpx

    port = _free_port()
    log = open(gguf.with_suffix(".log"), "w")
    proc = subprocess.Popen([SERVER, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx),
                             "-np", str(slots), "-t", "2", "--no-webui"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"llama-server exited: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama-server did not become healthy in 120 s")
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _gguf(folder, out: Path) -> Path:
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")
    subprocess.run([sys.executable, CONVERT, str(folder), "--outtype", "f32", "--outfile", str(out)], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    from rig_decode.models.embedded import is_pulled, model_dir

    if not is_pulled("smollm2-135m-instruct"):
        pytest.skip("embedded default model not pulled")
    gguf = _gguf(model_dir("smollm2-135m-instruct"), tmp_path_factory.mktemp("gguf") / "smollm2-135m-f32.gguf")
    yield from _serve(gguf)


@pytest.fixture(scope="module")
def merged_server(tmp_path_factory):
    """llama-server serving the embedded default with its marker adapter merged in (what the peers
    bench and a deployment serve)."""
    from rig_decode.config import RigConfig
    from rig_decode.models.embedded import is_pulled
    from rig_decode.models.merged import merged_checkpoint

    if not is_pulled("smollm2-135m-instruct"):
        pytest.skip("embedded default model not pulled")
    folder = merged_checkpoint(RigConfig().model, "float32")
    yield from _serve(_gguf(folder, tmp_path_factory.mktemp("gguf") / "merged-f32.gguf"), ctx=16384)


@pytest.mark.parametrize("rules", [{}, {"max_iterations": 1, "max_query_tokens": 4}], ids=["default", "budget-cap"])
def test_the_demo_on_llama_server_gives_the_in_process_answers(merged_server, rules):
    """``rig ask --backend remote`` on the merged model: the demo's answers and hop queries, under the
    default rules and under a hop budget of one and a query cap of four tokens (which the server's own
    greedy choice would break: the rules hold because the engine applies them)."""
    import json
    from importlib import resources

    from rig_decode import RigConfig, RigSession
    from rig_decode.adapters import embedded_adapter

    questions = [q["question"] for q in
                 json.loads((resources.files("rig_decode") / "data" / "demo_questions.json").read_text())]
    questions = questions[:2] if rules else questions  # the rules' variant on two of them (CI time)
    cfg = RigConfig().updated(model={"max_tokens": 160}, rig=rules)
    with RigSession(cfg) as session:
        expected = session.ask_batch(questions)
    remote = cfg.updated(model={"adapter": str(embedded_adapter("smollm2-135m-instruct"))},
                         engine={"backend": "remote", "remote": {"base_url": merged_server}})
    with RigSession(remote) as session:
        got = session.ask_batch(questions)
        calls = session.engine.runner.calls
    hops = 0
    for (a_answer, a_trace), (b_answer, b_trace) in zip(expected, got):
        assert b_answer == a_answer
        assert [s.query for s in b_trace.retrieval_steps] == [s.query for s in a_trace.retrieval_steps]
        assert b_trace.num_hops <= rules.get("max_iterations", 3)
        hops += b_trace.num_hops
        for step in b_trace.retrieval_steps:
            assert step.info["server"]["prompt_n"] <= step.evidence_tokens + 1, step.info
    assert hops >= len(questions)
    if not rules:  # nothing forced; the rows start together (4 slots), before any query has opened:
        # each row's first stretch without scores, then its query with them (2 a question); the model
        # searches first, so every stream after evidence asks for scores and runs on into the next
        # query (1 a hop: SCORED_LEAD)
        assert calls == 2 * len(questions) + hops, (calls, hops)


def test_remote_llamacpp_answers_like_the_in_process_backend(llama_server):
    from rig_decode import RigConfig, RigSession

    cfg = RigConfig.from_dict({"model": {"adapter": None, "max_tokens": 80},
                               "rig": {"retrieve_first": True, "max_query_tokens": 16, "max_iterations": 2,
                                       "evidence_token_budget": 256}})
    local = RigSession(cfg).ask_batch(QUESTIONS)
    remote_cfg = cfg.updated(engine={"backend": "remote", "remote": {"base_url": llama_server, "api": "auto"}})
    session = RigSession(remote_cfg)
    remote = session.ask_batch(QUESTIONS)
    session.close()
    for (a, ta), (b, tb) in zip(local, remote):
        assert b == a, (a, b)
        assert [s.query for s in tb.retrieval_steps] == [s.query for s in ta.retrieval_steps]
        assert tb.num_hops >= 1
        for step in tb.retrieval_steps:  # after each splice the server evaluated only the new tokens
            served = step.info["server"]
            assert served["prompt_n"] <= step.evidence_tokens + 1, served
            assert served["cache_n"] >= step.position - 1, served


def test_rig_serve_in_front_of_llama_server_answers_the_openai_client(merged_server):
    """``rig serve --backend remote`` in front of the real llama-server: the official ``openai`` client
    gets the in-process answer, plainly and streamed, the stream carrying each hop's query."""
    pytest.importorskip("openai")
    from rig_decode import RigConfig, RigSession
    from rig_decode.adapters import embedded_adapter
    from rig_decode.server import create_app

    from .server_helpers import ask_plain_and_streamed, serve

    question = QUESTIONS[0]
    cfg = RigConfig().updated(model={"max_tokens": 96})
    with RigSession(cfg) as session:
        local_answer, local_trace = session.ask(question)
    remote = cfg.updated(model={"adapter": str(embedded_adapter("smollm2-135m-instruct"))},
                         engine={"backend": "remote", "remote": {"base_url": merged_server}},
                         server={"model_name": "rig"})
    with RigSession(remote) as session, serve(create_app(remote, engine=session.engine)) as base:
        plain, text, hops = ask_plain_and_streamed(base, "rig", question)
    assert plain.choices[0].message.content == text == local_answer
    assert hops == [s.query for s in local_trace.retrieval_steps] and len(hops) >= 1
    assert [h["query"] for h in plain.model_extra["rig"]["hops"]] == hops
