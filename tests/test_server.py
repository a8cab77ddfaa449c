"""The OpenAI-compatible server, driven by the official ``openai`` client and by raw HTTP."""

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from rig_decode.server import create_app  # noqa: E402

from .helpers import ScriptedRetriever  # noqa: E402
from .server_helpers import ANSWER, QUERY, serve, tiny_config, tiny_engine, wait_for  # noqa: E402

MSG = [{"role": "user", "content": "Which release fixed error E1234?"}]


@pytest.fixture(scope="module")
def base(model, tok):
    app = create_app(tiny_config(), engine=tiny_engine(model, tok))
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _sse(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_and_health(client, base):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=MSG)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ANSWER and c.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    rig = r.model_extra["rig"]
    assert rig["num_hops"] == 1 and rig["hops"][0]["query"] == QUERY and rig["hops"][0]["docs"]
    assert {"id", "title", "score"} <= set(rig["hops"][0]["docs"][0]) and rig["evidence_tokens"] > 0
    assert "<|retrieve|>" not in c.message.content and "<evidence>" not in c.message.content


def test_chat_stream_never_splits_a_character(client):
    stream = client.chat.completions.create(model="tiny", messages=MSG, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == ANSWER
    assert len(deltas) > 3, "the answer came in one piece: not streamed"
    assert all("\ufffd" not in d for d in deltas)
    hops = [c.model_extra["rig"]["hop"] for c in chunks if not c.choices and "rig" in (c.model_extra or {})]
    assert [h["query"] for h in hops] == [QUERY]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_async_client_concurrent_requests(base):
    async def main():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        plain = [client.chat.completions.create(model="tiny", messages=MSG) for _ in range(4)]
        streamed = []
        for _ in range(3):
            stream = await client.chat.completions.create(model="tiny", messages=MSG, stream=True)
            streamed.append(stream)

        async def collect(stream):
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        done = await asyncio.gather(*plain, *(collect(s) for s in streamed))
        await client.close()
        return done

    results = asyncio.run(main())
    assert [r.choices[0].message.content for r in results[:4]] == [ANSWER] * 4
    assert results[4:] == [ANSWER] * 3


def test_completions_endpoint(client):
    r = client.completions.create(model="tiny", prompt="Release 4.2.1?")
    assert r.object == "text_completion" and r.choices[0].text == ANSWER and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny", prompt="Release 4.2.1?", stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ANSWER


def test_per_request_overrides_and_stop(client):
    off = client.chat.completions.create(model="tiny", messages=MSG, extra_body={"rig": {"retrieval": False}})
    assert off.choices[0].message.content == ANSWER and off.model_extra["rig"]["num_hops"] == 0
    raw = client.chat.completions.create(model="tiny", messages=MSG, extra_body={"rig": {"show_evidence": True}})
    content = raw.choices[0].message.content
    assert QUERY in content and "<evidence>" in content and content.endswith(ANSWER)
    few = client.chat.completions.create(model="tiny", messages=MSG, extra_body={"rig": {"top_k": 1}})
    assert len(few.model_extra["rig"]["hops"][0]["docs"]) == 1
    stopped = client.chat.completions.create(model="tiny", messages=MSG, stop=["東京"])
    assert stopped.choices[0].message.content == ANSWER[: ANSWER.index("東京")]
    assert stopped.choices[0].finish_reason == "stop"
    short = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
    assert short.choices[0].finish_reason == "length"


def _post(base, path, body=None, content=None, headers=None):
    return httpx.post(base + path, json=body, content=content, headers=headers, timeout=30)


@pytest.mark.parametrize("content, field", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"model": "tiny"}).encode(), "messages"),
    (json.dumps({"model": "tiny", "messages": MSG, "n": 2}).encode(), "n"),
    (json.dumps({"model": "tiny", "messages": MSG, "temperature": -1}).encode(), "temperature"),
    (json.dumps({"model": "tiny", "messages": MSG, "rig": {"max_hops": 2}}).encode(), "rig.max_hops"),
])
def test_malformed_requests_are_400(base, content, field):
    r = _post(base, "/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and field in err["message"]


def test_unknown_model_is_404(base):
    r = _post(base, "/v1/chat/completions", {"model": "gpt-9", "messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "gpt-9" in r.json()["error"]["message"]


def test_context_too_long_is_400_with_the_limits(base, model):
    limit = model.config.max_position_embeddings
    r = _post(base, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": limit})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert str(limit) in err["message"] and "prompt is" in err["message"]
    long = [{"role": "user", "content": "error E1234 " * limit}]
    r = _post(base, "/v1/chat/completions", {"model": "tiny", "messages": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_overload_is_429_and_the_server_keeps_serving(model, tok):
    engine = tiny_engine(model, tok, retriever=ScriptedRetriever(delay_s=1.5))
    app = create_app(tiny_config(max_concurrency=1), engine=engine)
    with serve(app) as base, httpx.Client(timeout=30) as http:
        with http.stream("POST", base + "/v1/chat/completions",
                         json={"model": "tiny", "messages": MSG, "stream": True}) as first:
            lines = first.iter_lines()
            next(lines)  # admitted and running (parked on the slow search)
            busy = http.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": MSG})
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
            assert busy.headers.get("retry-after")
            assert _sse(lines)[-1] == "[DONE]"
        assert wait_for(lambda: app.state.rig.front.num_active == 0)
        ok = http.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": MSG})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == ANSWER


def test_api_key(model, tok):
    app = create_app(tiny_config(api_key="s3cret"), engine=tiny_engine(model, tok))
    with serve(app) as base:
        body = {"model": "tiny", "messages": MSG}
        assert _post(base, "/v1/chat/completions", body).status_code == 401
        wrong = _post(base, "/v1/chat/completions", body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=MSG).choices[0].message.content == ANSWER


def test_client_disconnect_cancels_the_request(model, tok):
    # a slow search keeps the non-streaming request parked while its client gives up
    engine = tiny_engine(model, tok, endless=True, max_new_tokens=1000, retriever=ScriptedRetriever(delay_s=1.5))
    app = create_app(tiny_config(), engine=engine)
    with serve(app) as base, httpx.Client(timeout=30) as http:
        with http.stream("POST", base + "/v1/chat/completions",
                         json={"model": "tiny", "messages": MSG, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            seq = engine.running[0]
        assert wait_for(lambda: seq.is_finished)  # the socket closed: cancelled, not run to the end
        assert seq.finish_reason == "cancelled" and seq.num_generated < 1000
        assert wait_for(lambda: not engine.running and app.state.rig.front.num_active == 0)
        # and the non-streaming path: a client that gives up mid-request
        with pytest.raises(httpx.ReadTimeout):
            http.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": MSG}, timeout=0.5)
        assert wait_for(lambda: app.state.rig.front.num_active == 0)
        assert "rig_finished_total{reason=\"cancelled\"} 2.0" in http.get(base + "/metrics").text


def test_metrics(base, client):
    client.chat.completions.create(model="tiny", messages=MSG)
    text = httpx.get(base + "/metrics").text
    for name in ("rig_requests_total", "rig_tokens_total", "rig_hops_total", "rig_retrieval_latency_seconds_bucket",
                 "rig_splice_latency_seconds_bucket", "rig_queue_depth", "rig_parked_sequences",
                 "rig_running_sequences"):
        assert name in text, name
    assert 'rig_requests_total{endpoint="/v1/chat/completions",key="anonymous",status="200"}' in text


def test_playground_page_is_served(base):
    page = httpx.get(base + "/").text
    assert "<html" in page and "tiny" in page and "/v1/chat/completions" in page


def test_an_engine_failure_is_a_500_and_the_server_recovers(model, tok, monkeypatch):
    engine = tiny_engine(model, tok)
    app = create_app(tiny_config(), engine=engine)
    with serve(app) as base:
        real_step = engine.runner.step
        monkeypatch.setattr(engine.runner, "step", lambda rows: (_ for _ in ()).throw(RuntimeError("CUDA OOM")))
        r = _post(base, "/v1/chat/completions", {"model": "tiny", "messages": MSG})
        assert r.status_code == 500 and "CUDA OOM" in r.json()["error"]["message"]
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": MSG, "stream": True}) as s:
            events = _sse(s.iter_lines())
        assert any(isinstance(e, dict) and "error" in e for e in events) and events[-1] == "[DONE]"
        monkeypatch.setattr(engine.runner, "step", real_step)
        ok = _post(base, "/v1/chat/completions", {"model": "tiny", "messages": MSG})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == ANSWER
        metrics = httpx.get(base + "/metrics").text  # each request counted once, under its status
        assert 'rig_requests_total{endpoint="/v1/chat/completions",key="anonymous",status="500"} 1.0' in metrics
        assert 'rig_requests_total{endpoint="/v1/chat/completions",key="anonymous",status="200"} 2.0' in metrics  # stream + ok


def test_conversation_memory_across_requests(client):
    body = {"rig": {"conversation_id": "c-1"}}
    first = client.chat.completions.create(model="tiny", messages=MSG, extra_body=body)
    assert first.model_extra["rig"]["num_hops"] == 1
    follow = MSG + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And who approved it?"}]
    second = client.chat.completions.create(model="tiny", messages=follow, extra_body=body)
    hop = second.model_extra["rig"]["hops"][0]
    assert hop["info"]["reuse"]["query"] == QUERY and hop["docs"] == []  # same query: not searched again
    other = client.chat.completions.create(model="tiny", messages=follow, extra_body={"rig": {"conversation_id": "c-2"}})
    assert "reuse" not in other.model_extra["rig"]["hops"][0]["info"]


def test_seed_reproduces_a_sampled_answer(model, tok):
    from rig_decode.engine import EngineOptions, RigEngine

    engine = RigEngine(model, tok, ScriptedRetriever(), EngineOptions(max_iterations=0, max_new_tokens=24))
    with serve(create_app(tiny_config(), engine=engine)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

        def sampled(seed):
            return client.completions.create(model="tiny", prompt="Release 4.2.1?", temperature=1.0,
                                             seed=seed).choices[0].text

        first = sampled(7)
        assert sampled(7) == first and sampled(8) != first


def test_more_bad_requests_are_400(base):
    r = _post(base, "/v1/completions", {"model": "tiny", "prompt": "x", "rig": {"conversation_id": "c"}})
    assert r.status_code == 400 and "conversation_id" in r.json()["error"]["message"]
    r = _post(base, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "seed": -1})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    r = _post(base, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_hung_searches_degrade_retrieval_in_health_and_metrics_until_they_return(model, tok):
    from rig_decode.retrieval.chaos import FaultyRetriever

    hang = {"on": True}
    retriever = FaultyRetriever(ScriptedRetriever(), lambda call, queries: "hang" if hang["on"] else None, hang_s=30)
    engine = tiny_engine(model, tok, retriever=retriever, retrieval_timeout_s=0.2, max_hung_searches=1)
    app = create_app(tiny_config(), engine=engine)
    body = {"model": "tiny", "messages": MSG}
    try:
        with serve(app) as base, httpx.Client(timeout=30) as http:
            first = http.post(base + "/v1/chat/completions", json=body).json()
            assert first["choices"][0]["message"]["content"] == ANSWER
            assert "timed out" in first["rig"]["hops"][0]["error"]
            health = http.get(base + "/health").json()
            assert health["status"] == "ok" and health["retrieval"] == "degraded"
            assert "1 searches still running past timeout_s" in health["retrieval_reason"]
            assert "rig_retrieval_degraded 1.0" in http.get(base + "/metrics").text
            second = http.post(base + "/v1/chat/completions", json=body).json()  # no wait for a search
            hop = second["rig"]["hops"][0]
            assert "retrieval degraded" in hop["error"] and hop["latency_ms"] == 0.0
            hang["on"] = False
            retriever.release()
            assert wait_for(lambda: http.get(base + "/health").json()["retrieval"] == "ok")
            third = http.post(base + "/v1/chat/completions", json=body).json()
            assert third["rig"]["hops"][0]["error"] is None and third["rig"]["hops"][0]["docs"]
            metrics = http.get(base + "/metrics").text
            assert "rig_retrieval_degraded 0.0" in metrics and "rig_hop_errors_total 2.0" in metrics
    finally:
        retriever.release()
