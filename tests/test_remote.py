"""The remote backend: the engine over a completion server gives the in-process engine's tokens,
asks the server once per hop rather than once per token, and reports the server's cache use."""

import pytest

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.runner_remote import RemoteRunner
from rig_decode.engine.servers import LlamaCppServer, RemoteError, make_server
from rig_decode.engine.runner_stream import StreamingRunner
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ForceScript, ScriptedRetriever
from .remote_helpers import FakeLlamaServer
from .test_exactness import PROMPTS, _script


def _engine(model, tok, script, runner=None, **opts):
    options = EngineOptions(**{"max_iterations": 3, "max_new_tokens": 70, "evidence_token_budget": 64, "top_k": 2,
                               **opts})
    return RigEngine(None if runner else model, tok, ScriptedRetriever(), options,
                     extra_processors=[ForceScript(script)], runner=runner)


def _generate(engine, tok, prompts):
    seqs = [engine.new_sequence(tok.encode(p), seq_id=i) for i, p in enumerate(prompts)]
    engine.generate(seqs)
    return seqs


RUNNERS = {"lookahead": lambda server, n: RemoteRunner(server, n, lookahead=16, top_logprobs=20),
           "streaming": lambda server, n: StreamingRunner(server, n, top_logprobs=20)}


@pytest.mark.parametrize("kind", list(RUNNERS))
@pytest.mark.parametrize("opts", [{}, {"retrieve_first": True, "max_query_tokens": 6}])
def test_remote_runner_gives_the_in_process_tokens(model, tok, opts, kind):
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _generate(_engine(model, tok, script, **opts), tok, PROMPTS)
    with FakeLlamaServer(model, tok.eos_token_id) as server:
        runner = RUNNERS[kind](LlamaCppServer(server.url), len(tok))
        remote = _generate(_engine(model, tok, script, runner=runner, **opts), tok, PROMPTS)
        assert all(r["stream"] == (kind == "streaming") for r in server.requests)
    for a, b in zip(local, remote):
        assert b.token_ids == a.token_ids and b.mask == a.mask
        assert b.trace.num_hops == a.trace.num_hops > 0
    for s in remote:
        for step in s.trace.retrieval_steps:
            if step.evidence_tokens:  # the call after the splice evaluated only the new tokens
                server_info = step.info["server"]
                assert server_info["prompt_n"] <= step.evidence_tokens + 1, (server_info, step.evidence_tokens)
                assert server_info["cache_n"] >= step.position - 1


def plain_answers(model, tok, runner, n: int = 40):
    """A 40-token answer with no hop through ``runner``, and the in-process engine's."""
    out = []
    for engine in (_engine(model, tok, {}, runner=runner, max_iterations=0), _engine(model, tok, {}, max_iterations=0)):
        out.append(engine.new_sequence(tok.encode(PROMPTS[0]), max_new_tokens=n))
        engine.generate(out[-1:])
    return out


def test_the_lookahead_serves_the_models_own_tokens(model, tok):
    """Where nothing forces a token, one call serves ``lookahead`` steps."""
    with FakeLlamaServer(model, tok.eos_token_id) as server:
        runner = RemoteRunner(LlamaCppServer(server.url), len(tok), lookahead=8)
        seq, ref = plain_answers(model, tok, runner)
    assert seq.token_ids == ref.token_ids
    assert runner.calls == -(-seq.num_generated // 8), (runner.calls, seq.num_generated)


def test_remote_errors_name_the_server(model, tok):
    with FakeLlamaServer(model, tok.eos_token_id) as server:
        assert isinstance(make_server("auto", server.url), LlamaCppServer)
        with pytest.raises(RemoteError, match="/completion answered 400"):
            LlamaCppServer(server.url).post("/completion", {"prompt": "text, not ids"})
        runner = RemoteRunner(LlamaCppServer(server.url), vocab_size=10)  # a tokenizer smaller than the model's
        runner.add_rows([[1, 2, 3]])
        with pytest.raises(RemoteError, match="same model"):
            runner.step([[1, 2, 3]])
    with pytest.raises(RemoteError, match="ConnectError"):
        LlamaCppServer(server.url, timeout_s=2).complete([1, 2], 1, 1)
    with pytest.raises(ValueError, match="unknown remote api"):
        make_server("grpc", "http://127.0.0.1:1")


def test_a_session_with_the_remote_backend_answers_like_the_in_process_one(model, tok):
    from rig_decode import RigConfig, RigSession

    question = "Which release fixed error E1234 and who approved it?"
    # no adapter on either side (a server runs its own weights): both use the built-in instruction
    cfg = RigConfig().updated(model={"max_tokens": 40, "adapter": None},
                              rig={"retrieve_first": True, "max_query_tokens": 8})
    local_answer, local_trace = RigSession(cfg, model=model, tokenizer=tok, retriever=ScriptedRetriever()).ask(question)
    with FakeLlamaServer(model, tok.eos_token_id) as server:
        remote_cfg = cfg.updated(engine={"backend": "remote", "remote": {"base_url": server.url, "api": "llama.cpp"}})
        session = RigSession(remote_cfg, tokenizer=tok, retriever=ScriptedRetriever())
        answer, trace = session.ask(question)
        session.close()
    assert answer == local_answer and trace.num_hops == local_trace.num_hops == 1
    assert trace.retrieval_steps[0].info["server"]["prompt_n"] <= trace.retrieval_steps[0].evidence_tokens + 1


def test_remote_backend_config_needs_a_url():
    from rig_decode.config import ConfigError, RigConfig

    with pytest.raises(ConfigError, match="engine.remote.base_url is required"):
        RigConfig.from_dict({"engine": {"backend": "remote"}})
    cfg = RigConfig.from_dict({"engine": {"backend": "remote", "remote": {"base_url": "http://127.0.0.1:8080"}}})
    assert cfg.served_model().adapter is None  # the server serves its own weights: no local adapter
