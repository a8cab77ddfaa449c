"""The vLLM backend, against a stand-in ``AsyncLLM`` over the tiny model (``vllm_helpers``): the
in-process engine's tokens in both modes, only new tokens evaluated after a hop, sessions that end
with their rows, the marker logits processor's rules, the config and the error without vLLM."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rig_decode.config import ConfigError, RigConfig
from rig_decode.engine.runner_vllm import vllm_runner, vllm_runner_on
from rig_decode.engine.vllm_api import CPU_KV_CACHE_GIB, LOGITS_PROCESSOR, VllmMissingError, engine_args_kwargs, load_vllm_api
from rig_decode.engine.vllm_logits import EXTRA_ARGS_KEY, MarkerLogitsState, MarkerRules
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ScriptedRetriever, load_script, tiny_model
from .test_exactness import PROMPTS, _script
from .test_remote import _engine, _generate
from .vllm_helpers import FakeAsyncLLM, SamplingParams, StandInMarkerProcessor, TokensPrompt, fake_api, writes_like

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {"plain": {}, "first-hop-and-cap": {"retrieve_first": True, "max_query_tokens": 6}}
_LOCAL: dict[str, list] = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def _local(model, tok, script, name):
    if name not in _LOCAL:
        _LOCAL[name] = _generate(_engine(model, tok, script, **OPTIONS[name]), tok, PROMPTS)
    return _LOCAL[name]


def _runner(model, tok, mode, fake=None, **kwargs):
    fake = fake or FakeAsyncLLM(model, tok.eos_token_id)
    return fake, vllm_runner_on(fake, fake_api(model, tok.eos_token_id), len(tok), mode=mode, context_limit=2048,
                            timeout_s=120, **kwargs)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("mode", ["stream", "prefix"])
def test_vllm_runner_gives_the_in_process_tokens(model, tok, mode, name):
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _local(model, tok, script, name)
    fake, runner = _runner(model, tok, mode)
    out = _generate(_engine(model, tok, script, runner=runner, **OPTIONS[name]), tok, PROMPTS)
    runner.close()
    for a, b in zip(local, out):
        assert b.token_ids == a.token_ids and b.mask == a.mask
        assert b.trace.num_hops == a.trace.num_hops > 0
    assert fake.max_waiting == len(PROMPTS)  # the rows' first requests were in flight together
    first_lookups = {r["reported"] for r in fake.requests if r["kind"] == "chunk"}
    for s in out:
        for step in s.trace.retrieval_steps:
            if not step.evidence_tokens:
                continue
            info = step.info["server"]
            assert info["mode"] == mode
            if mode == "stream" and info["cache_n"] != info["num_cached_tokens"]:  # the session went on: the hop's
                assert info["cache_n"] == step.position - 1, info  # chunk is the marker token and the evidence
                assert info["prompt_n"] == step.evidence_tokens + 1, info
                # vLLM's own figure is still the session's first prefix-cache lookup, not what it kept
                assert info["num_cached_tokens"] in first_lookups and info["num_cached_tokens"] < info["cache_n"]
            else:  # a new request (in stream mode: a forced token ended the session): whole blocks cached, at
                assert info["num_cached_tokens"] == info["cache_n"]  # most the partial last one evaluated again
                assert info["cache_n"] % fake.block_size == 0
                assert info["cache_n"] + info["prompt_n"] == step.position + step.evidence_tokens


def test_stream_mode_decodes_freely_and_a_hop_is_one_call(tok_special):
    """A model that writes its markers itself (the stand-in steered to what the engine takes): each
    row's answer is one chunk per stretch between hops, stopping at the end delimiter; each hop
    evaluates the marker token and the evidence on the session's KV; sessions end with their rows."""
    tok, model = tok_special, tiny_model(len(tok_special))
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _generate(_engine(model, tok, script), tok, PROMPTS)
    fake, runner = _runner(model, tok, "stream", fake=FakeAsyncLLM(model, tok.eos_token_id, steer=writes_like(local)))
    engine = _engine(model, tok, script, runner=runner)
    out = _generate(engine, tok, PROMPTS)
    assert [s.token_ids for s in out] == [s.token_ids for s in local]
    hops = sum(s.trace.num_hops for s in out)
    assert runner.calls == len(PROMPTS) + hops, (runner.calls, hops)
    chunks = [r for r in fake.requests if r["kind"] == "chunk"]
    assert len({r["id"] for r in chunks}) == len(PROMPTS)  # one session per row, never restarted
    assert all(r["max_tokens"] > 100 and tok.eos_token_id in r["stop_token_ids"] for r in chunks)
    for s in out:
        for step in s.trace.retrieval_steps:
            info = step.info["server"]
            assert (info["cache_n"], info["prompt_n"]) == (step.position - 1, step.evidence_tokens + 1), info
    # vLLM decoded little past what the engine took: up to each row's end (where the engine stopped it)
    decoded = sum(r["decoded"] for r in chunks)
    assert decoded <= sum(s.num_generated for s in out) + 4 * len(chunks), decoded
    deadline = time.monotonic() + 10
    while fake.sessions_open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fake.sessions_open and len(fake.sessions_ended) == len(PROMPTS)
    engine.close()
    assert fake.shut_down is False  # an injected engine belongs to its owner


def test_a_session_that_dies_mid_chunk_fails_its_row_alone(model, tok):
    class DiesMidChunk(FakeAsyncLLM):
        started = 0

        async def generate(self, prompt, sampling_params, request_id):
            self.started += 1
            doomed, k = self.started == 2, 0  # the second row's session
            async for out in super().generate(prompt, sampling_params, request_id):
                yield out
                k += 1
                if doomed and k == 3:
                    raise RuntimeError("vLLM's engine core died")

    local = _generate(_engine(model, tok, {}, max_new_tokens=20), tok, PROMPTS)
    fake, runner = _runner(model, tok, "stream", fake=DiesMidChunk(model, tok.eos_token_id))
    out = _generate(_engine(model, tok, {}, runner=runner, max_new_tokens=20), tok, PROMPTS)
    runner.close()
    assert "engine core died" in " ".join(out[1].trace.engine_errors)
    assert [s.token_ids for s in (out[0], out[2])] == [s.token_ids for s in (local[0], local[2])]
    assert not out[0].trace.engine_errors and not out[2].trace.engine_errors


def test_a_session_vllm_ends_while_its_row_searches_is_replaced(tok_special, monkeypatch):
    """vLLM ends a row's request between chunks (an abort, an engine restart) while the row searches:
    the row's next chunk goes to a new session (no wait for a token that never comes), and every row
    gets the in-process tokens."""
    from rig_decode.engine import runner_vllm_stream

    class EndsWhileParked(FakeAsyncLLM):
        async def generate(self, prompt, sampling_params, request_id):
            async for out in super().generate(prompt, sampling_params, request_id):
                yield out
                if request_id == "rig-doomed" and out.outputs[0].finish_reason is not None:
                    return  # the session's stream ends after its first chunk

    class Named(runner_vllm_stream._Session):
        made = 0

        def __init__(self):
            super().__init__()
            Named.made += 1
            if Named.made == 1:  # the first row's session
                self.request_id = "rig-doomed"

    tok, model = tok_special, tiny_model(len(tok_special))
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _generate(_engine(model, tok, script), tok, PROMPTS)
    fake, runner = _runner(model, tok, "stream", fake=EndsWhileParked(model, tok.eos_token_id, steer=writes_like(local)))
    monkeypatch.setattr(runner_vllm_stream, "_Session", Named)
    out = _generate(_engine(model, tok, script, runner=runner), tok, PROMPTS)
    runner.close()
    runner.close()  # twice: a no-op
    assert [s.token_ids for s in out] == [s.token_ids for s in local]
    assert not any(s.trace.engine_errors for s in out)
    assert len({r["id"] for r in fake.requests}) == len(PROMPTS) + 1  # the ended one, replaced once


def test_prefix_mode_serves_steps_from_the_lookahead(model, tok):
    fake, runner = _runner(model, tok, "prefix", lookahead=8)
    engine = _engine(model, tok, {}, runner=runner, max_iterations=0)
    seq = engine.new_sequence(tok.encode(PROMPTS[0]), max_new_tokens=40)
    engine.generate([seq])
    assert runner.calls == -(-seq.num_generated // 8), (runner.calls, seq.num_generated)
    assert all(r["kind"] == "prefix" and r["max_tokens"] == 8 for r in fake.requests)
    assert not fake.sessions_ended
    runner.close()


def test_a_stream_runner_built_from_the_config_waits_a_bounded_time_for_a_token(model, tok):
    from rig_decode.engine.runner_vllm_stream import TOKEN_TIMEOUT_S

    cfg = RigConfig.from_dict({"model": {"name": "org/m"}, "engine": {"backend": "vllm"}})
    runner = vllm_runner(cfg, len(tok), api=fake_api(model, tok.eos_token_id))
    assert runner.mode == "stream" and runner.timeout_s == TOKEN_TIMEOUT_S
    runner.close()


def test_auto_mode_follows_what_vllm_has(model, tok):
    fake = FakeAsyncLLM(model, tok.eos_token_id)
    with_stream = vllm_runner_on(fake, fake_api(model, tok.eos_token_id), len(tok))
    without = vllm_runner_on(fake, fake_api(model, tok.eos_token_id, streaming=False), len(tok))
    assert (with_stream.mode, without.mode) == ("stream", "prefix")
    with pytest.raises(ValueError, match="StreamingInput"):
        vllm_runner_on(fake, fake_api(model, tok.eos_token_id, streaming=False), len(tok), mode="stream")
    for r in (with_stream, without):
        r.close()


def test_a_session_with_the_vllm_backend_answers_like_the_in_process_one(model, tok, monkeypatch):
    from rig_decode import RigSession
    from rig_decode.engine import vllm_api

    built = []
    monkeypatch.setattr(vllm_api, "load_vllm_api", lambda: fake_api(model, tok.eos_token_id, built=built))
    question = "Which release fixed error E1234 and who approved it?"
    cfg = RigConfig().updated(model={"max_tokens": 40, "adapter": None},
                              rig={"retrieve_first": True, "max_query_tokens": 8})
    local_answer, local_trace = RigSession(cfg, model=model, tokenizer=tok, retriever=ScriptedRetriever()).ask(question)
    vllm_cfg = cfg.updated(model={"name": "org/served-model"},
                           engine={"backend": "vllm", "vllm": {"max_model_len": 2048}})
    session = RigSession(vllm_cfg, tokenizer=tok, retriever=ScriptedRetriever())
    answer, trace = session.ask(question)
    session.close()
    assert answer == local_answer and trace.num_hops == local_trace.num_hops == 1
    info = trace.retrieval_steps[0].info["server"]
    # the forced first marker and query cap ended sessions (the stand-in model does not write markers):
    # the hop's request took the prefix cache's whole blocks and evaluated the rest
    assert info["mode"] == "stream" and info["prompt_n"] <= trace.retrieval_steps[0].evidence_tokens + 16
    (engine,) = built
    assert engine.shut_down  # the session's runner built the engine, and shut it down
    args = engine.engine_args
    assert (args.model, args.max_model_len, args.enable_prefix_caching, args.quantization) == \
        ("org/served-model", 2048, True, None)


# -- the marker logits processor ----------------------------------------------------------------------

RULES = MarkerRules(start_id=5, end_id=6, stop_ids=(2,), max_iterations=1, max_query_tokens=3)


def _decide(rules, prompt, output):
    state = MarkerLogitsState()
    params = SimpleNamespace(extra_args=rules.to_extra_args())
    state.update(SimpleNamespace(removed=[], added=[(0, params, prompt, output)], moved=[]))
    return state.requests[0].decide()


def test_marker_rules_on_token_lists():
    assert _decide(RULES, [1, 9], []) == ([], None)
    assert _decide(RULES, [1, 9], [5, 7]) == ([2], None)  # inside a query: no EOS
    assert _decide(RULES, [1, 9], [5, 7, 8, 9]) == ([], 6)  # at the query cap: the end marker is forced
    assert _decide(RULES, [1, 9], [5, 7, 6, 4]) == ([5], None)  # the hop budget is spent
    # a streaming chunk re-adds the request with its earlier output folded into the prompt
    assert _decide(RULES, [1, 9, 5, 7, 6], [4]) == ([5], None)
    # markers in the instruction part of the prompt (before count_from) do not count
    prompt = [5, 7, 6, 1, 9]
    assert _decide(RULES, prompt, []) == ([5], None)
    assert _decide(MarkerRules(5, 6, (2,), 1, 3, count_from=3), prompt, []) == ([], None)
    assert _decide(MarkerRules(5, 6, (2,), 0, 3), [1], []) == ([5], None)


def test_marker_state_follows_the_live_output_list_and_batch_moves():
    state = MarkerLogitsState()
    params = SimpleNamespace(extra_args=RULES.to_extra_args())
    out_a, out_b = [], [5]
    state.update(SimpleNamespace(removed=[], added=[(0, params, [1], out_a), (1, params, [1], out_b),
                                                    (2, SimpleNamespace(extra_args=None), [1], [])], moved=[]))
    assert set(state.requests) == {0, 1}  # a request without rules is not tracked
    out_a += [5, 7, 8, 9]  # vLLM appends to the list it handed over
    logits = torch.zeros(3, 10)
    state.apply(logits)
    assert torch.isinf(logits[0]).sum() == 9 and logits[0, 6] == 0  # forced end
    assert torch.isinf(logits[1, 2]) and torch.isinf(logits[1]).sum() == 1  # no EOS in the query
    assert not torch.isinf(logits[2]).any()
    out_a.clear()  # cleared: counted again from the prompt
    assert state.requests[0].decide() == ([], None)
    state.update(SimpleNamespace(removed=[], added=[], moved=[(0, 1, SimpleNamespace(name="SWAP"))]))
    assert state.requests[0].output_ids is out_b and state.requests[1].output_ids is out_a
    state.update(SimpleNamespace(removed=[1], added=[], moved=[(0, 2, SimpleNamespace(name="UNIDIRECTIONAL"))]))
    assert set(state.requests) == {2} and state.requests[2].output_ids is out_b
    state.update(None)
    assert set(state.requests) == {2}


def test_marker_rules_validation_and_token_ids(tok, tok_special):
    with pytest.raises(ValueError, match="malformed"):
        MarkerLogitsState.validate(SimpleNamespace(extra_args={EXTRA_ARGS_KEY: {"start_id": 5}}))
    with pytest.raises(ValueError, match="max_query_tokens"):
        MarkerRules.from_extra_args({EXTRA_ARGS_KEY: {**RULES.to_extra_args()[EXTRA_ARGS_KEY], "max_query_tokens": 0}})
    MarkerLogitsState.validate(SimpleNamespace(extra_args=None))
    rules = MarkerRules.from_tokenizer(tok_special, [tok_special.eos_token_id], 2, 16)
    assert tok_special.decode([rules.start_id]) == "<|retrieve|>" and rules.stop_ids == (tok_special.eos_token_id,)
    with pytest.raises(ValueError, match="single tokens"):
        MarkerRules.from_tokenizer(tok, [tok.eos_token_id], 2, 16)


@pytest.mark.parametrize("mode", ["stream", "prefix"])
def test_every_request_carries_the_rules_counted_from_the_prompts_end(model, tok, mode):
    rules = MarkerRules(5, 6, (tok.eos_token_id,), 2, 8)
    fake, runner = _runner(model, tok, mode, marker_rules=rules)
    engine = _engine(model, tok, {}, runner=runner)
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    engine.generate([engine.new_sequence(p, seq_id=i, max_new_tokens=6) for i, p in enumerate(prompts)])
    engine.close()
    sent = {MarkerRules.from_extra_args(r["extra_args"]) for r in fake.requests}
    assert sent == {MarkerRules(5, 6, (tok.eos_token_id,), 2, 8, count_from=len(p)) for p in prompts}


def test_vllm_samples_under_the_processor_but_reports_raw_logprobs(model, tok):
    """Through the stand-in engine and the plugin's body: the pick follows the rules, the engine
    still sees the raw log-probabilities (vLLM's default ``logprobs_mode``)."""
    ids = tok.encode(PROMPTS[0])
    with torch.no_grad():
        best = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
    fake = FakeAsyncLLM(model, tok.eos_token_id, logits_processors=[StandInMarkerProcessor])
    rules = MarkerRules(best, best + 1, (tok.eos_token_id,), max_iterations=0, max_query_tokens=4)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, extra_args=rules.to_extra_args())

    async def one():
        return [o async for o in fake.generate(TokensPrompt(prompt_token_ids=ids), params, "r")][-1]

    out = asyncio.run(one()).outputs[0]
    assert out.token_ids[0] != best
    assert max(out.logprobs[0].items(), key=lambda kv: kv[1].logprob)[0] == best


# -- config and construction --------------------------------------------------------------------------

def test_vllm_backend_config():
    cfg = RigConfig.from_dict({"engine": {"backend": "vllm"}})
    v = cfg.engine.vllm
    assert (v.mode, v.max_model_len, v.gpu_memory_utilization, v.kv_cache_gib, v.enforce_eager, v.block_size,
            v.top_logprobs, v.lookahead, v.logits_processor) == ("auto", 8192, 0.9, None, None, None, 20, 16, False)
    assert cfg.served_model().adapter == "auto"  # served merged into a checkpoint of vLLM's (models/merged.py)
    for bad, expected in [
        ({"engine": {"backend": "vllm"}, "rig": {"append_format": "summary"}}, "which vLLM does not expose"),
        ({"engine": {"backend": "vllm", "zero_prefill": {"enabled": True}}}, "which vLLM does not expose"),
        ({"engine": {"backend": "remote", "remote": {"base_url": "http://x"}}, "rig": {"append_format": "summary"}},
         "which a remote server does not expose"),
        ({"engine": {"vllm": {"mode": "paged"}}}, "engine.vllm.mode"),
        ({"engine": {"vllm": {"gpu_memory_utilization": 1.5}}}, "engine.vllm.gpu_memory_utilization"),
        ({"engine": {"vllm": {"top_logprobs": 0}}}, "engine.vllm.top_logprobs"),
        ({"engine": {"vllm": {"kv_cache_gib": 0}}}, "engine.vllm.kv_cache_gib"),
        ({"engine": {"vllm": {"block_size": 0}}}, "engine.vllm.block_size"),
        ({"engine": {"vllm": {"swap_space": 4}}}, "engine.vllm.swap_space: unknown key"),
        ({"engine": {"backend": "tensorrt"}}, "engine.backend"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            RigConfig.from_dict(bad)


def test_engine_args_from_the_config():
    cfg = RigConfig.from_dict({"model": {"name": "Qwen/Qwen2.5-32B-Instruct", "quantization": "nf4",
                                         "dtype": "bfloat16", "seed": 7},
                               "engine": {"backend": "vllm", "vllm": {"max_model_len": 4096, "top_logprobs": 50,
                                                                      "enforce_eager": True,
                                                                      "logits_processor": True}}})
    cuda = SimpleNamespace(version="x", quantization_methods=None, device="cuda")
    kwargs = engine_args_kwargs(cfg, cuda)
    assert kwargs == {"model": "Qwen/Qwen2.5-32B-Instruct", "dtype": "bfloat16", "max_model_len": 4096,
                      "gpu_memory_utilization": 0.9, "enforce_eager": True, "enable_prefix_caching": True,
                      "seed": 7, "max_logprobs": 50, "quantization": "bitsandbytes",
                      "logits_processors": [LOGITS_PROCESSOR]}
    module, name = LOGITS_PROCESSOR.split(":")
    assert module == "rig_decode.engine.vllm_logits" and name == "RigMarkerLogitsProcessor"
    # a vLLM that lists bitsandbytes takes the same arguments; one without it (0.33.0) refuses nf4 up front
    with_bnb = SimpleNamespace(version="x", quantization_methods=("awq", "bitsandbytes"), device="cuda")
    assert engine_args_kwargs(cfg, with_bnb) == kwargs
    without = SimpleNamespace(version="0.33.0", quantization_methods=("awq", "gptq", "fp8"), device="cuda")
    with pytest.raises(ValueError, match="nf4 loads with vLLM's bitsandbytes quantization, which vLLM 0.33.0"):
        engine_args_kwargs(cfg, without)
    assert "quantization" not in engine_args_kwargs(cfg.updated(model={"quantization": "none"}), without)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_engine_args_default_to_the_in_process_dtype_and_on_a_cpu_to_eager_and_a_fixed_kv_space(device):
    api = SimpleNamespace(version="x", quantization_methods=None, device=device)
    cfg = RigConfig.from_dict({"model": {"name": "org/m"}, "engine": {"backend": "vllm"}})
    kwargs = engine_args_kwargs(cfg, api)
    on_cpu = device == "cpu"
    # model.dtype auto is what loader.resolve_dtype picks in process: fp32 on a CPU, bf16 on CUDA
    assert kwargs["dtype"] == ("float32" if on_cpu else "bfloat16")
    assert kwargs["enforce_eager"] is on_cpu
    assert kwargs.get("kv_cache_memory_bytes") == (int(CPU_KV_CACHE_GIB * 2**30) if on_cpu else None)
    assert "block_size" not in kwargs
    set_ = cfg.updated(model={"dtype": "bfloat16"},
                       engine={"vllm": {"kv_cache_gib": 0.5, "enforce_eager": False, "block_size": 16}})
    kwargs = engine_args_kwargs(set_, api)
    assert (kwargs["dtype"], kwargs["enforce_eager"], kwargs["kv_cache_memory_bytes"], kwargs["block_size"]) == (
        "bfloat16", False, 2**29, 16)


def test_nf4_on_a_vllm_without_bitsandbytes_fails_before_any_thread_starts(model, tok, monkeypatch):
    from rig_decode.engine import runner_vllm

    loops, built = [], []
    monkeypatch.setattr(runner_vllm, "EventLoopThread", lambda *a, **k: loops.append(a))
    cfg = RigConfig.from_dict({"model": {"name": "org/m", "quantization": "nf4"}, "engine": {"backend": "vllm"}})
    api = fake_api(model, tok.eos_token_id, built=built, quantization_methods=("awq", "fp8"))
    with pytest.raises(ValueError, match="bitsandbytes"):
        vllm_runner(cfg, len(tok), api=api)
    assert not built and not loops


def test_the_logits_processor_needs_single_token_markers(model, tok, tok_special, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = RigConfig.from_dict({"model": {"name": "org/m"},
                               "engine": {"backend": "vllm", "vllm": {"logits_processor": True}}})
    with pytest.raises(ValueError, match="single tokens"):
        vllm_runner(cfg, len(tok), tokenizer=tok, api=fake_api(model, tok.eos_token_id))
    built = []
    runner = vllm_runner(cfg, len(tok_special), tokenizer=tok_special, api=fake_api(model, 2, built=built))
    assert built[0].engine_args.logits_processors == [LOGITS_PROCESSOR]
    assert runner.marker_rules.start_id == tok_special.convert_tokens_to_ids("<|retrieve|>")
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the plugin has the V1 runner's interface
    runner.close()
    assert built[0].shut_down


def test_without_vllm_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(VllmMissingError, match=r"\./scripts/setup\.sh --vllm installs it"):
        load_vllm_api()
    from rig_decode import RigSession

    cfg = RigConfig.from_dict({"model": {"name": "/nonexistent/model"}, "engine": {"backend": "vllm"}})
    with pytest.raises(VllmMissingError):  # before any model file is looked for
        RigSession(cfg, retriever=ScriptedRetriever())


def test_rig_ask_and_serve_take_the_vllm_backend():
    from rig_decode.cli import _load_config, build_parser

    for argv in (["ask", "q", "--backend", "vllm"], ["serve", "--backend", "vllm"]):
        assert _load_config(build_parser().parse_args(argv)).engine.backend == "vllm"


def test_rig_ask_without_vllm_says_what_to_install():
    code = ("import sys; sys.modules['vllm'] = None; from rig_decode.cli import main; "
            "sys.exit(main(['ask', 'hello', '--backend', 'vllm']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rig: error: engine.backend: vllm needs vLLM" in proc.stderr
    assert "./scripts/setup.sh --vllm installs it" in proc.stderr


# -- bench/vllm_gpu.py --------------------------------------------------------------------------------

def _bench_module():
    return load_script("bench/vllm_gpu.py")


def test_bench_runs_its_three_modes_on_the_stand_in(model, tok, monkeypatch):
    from rig_decode.engine.runner_vllm import EventLoopThread

    bench = _bench_module()
    # short prompts (the built-in instruction is ~700 tiny-tokenizer tokens) keep the stand-in quick
    monkeypatch.setattr(bench, "prompts", lambda tokenizer, n: [tokenizer.encode(PROMPTS[i % 3]) for i in range(n)])
    args = bench.parse_args(["--questions", "2", "--hops", "2", "--segment", "4", "--evidence-tokens", "24",
                             "--lookahead", "4", "--max-model-len", "2048"])
    fake, loop = FakeAsyncLLM(model, tok.eos_token_id), EventLoopThread()
    try:
        result = bench.run(fake, fake_api(model, tok.eos_token_id), tok, loop, args)
    finally:
        loop.close()
    assert result["errors"] == {} and set(result["modes"]) == {"stream", "prefix", "reprefill"}
    assert result["stream_prefix_same_tokens"] == "2/2"
    for mode, r in result["modes"].items():
        assert [h["hop"] for h in r["hops"]] == [1, 2] and all(h["rows"] == 2 for h in r["hops"]), mode
        assert r["decode_tok_s"] > 0 and r["generated_tokens"] > 0
    for h in result["modes"]["stream"]["hops"]:  # forced markers end sessions (the model does not write
        assert h["evaluated"] < h["evidence_tokens"] + 1 + fake.block_size  # them): whole blocks come cached
    for h in result["modes"]["reprefill"]["hops"]:  # salted requests: nothing from the prefix cache
        assert h["cached"] == 0 and h["evaluated"] > h["evidence_tokens"]
    assert not fake.sessions_open


def test_bench_skips_without_cuda():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_gpu.py"), "--questions", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped" in json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_parallelism_reaches_the_engine_args():
    """tensor / pipeline parallel size and the executor: the way past one GPU, set from the config."""
    api = SimpleNamespace(version="x", quantization_methods=None, device="cuda")
    cfg = RigConfig.from_dict({"model": {"name": "org/m"}, "engine": {"backend": "vllm", "vllm": {
        "tensor_parallel_size": 4, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}}})
    kwargs = engine_args_kwargs(cfg, api)
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"],
            kwargs["distributed_executor_backend"]) == (4, 2, "ray")
    assert "tensor_parallel_size" not in engine_args_kwargs(RigConfig.from_dict(
        {"model": {"name": "org/m"}, "engine": {"backend": "vllm"}}), api)  # one GPU: vLLM's defaults
    try:
        real = load_vllm_api()
    except VllmMissingError:
        return
    args = real.AsyncEngineArgs(**kwargs)  # vLLM's own argument object takes them
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend) == (4, 2, "ray")
