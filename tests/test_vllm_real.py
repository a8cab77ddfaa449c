"""The vLLM backend on real vLLM (its CPU build here, ``./scripts/setup.sh --vllm``) serving the
embedded default with its marker adapter merged in: the in-process backend's token ids and loss masks
in stream and prefix mode, with and without the marker logits processor, on a ragged batch whose rows
hop at different steps; stream mode evaluates exactly a hop's evidence + 1 tokens, prefix mode at
most one KV block more; the demo's answers and hop queries; a clean engine shutdown.

One vLLM engine per processor setting serves every runner of this module (an engine start costs most
of a minute on a CPU). ``RIG_REQUIRE_VLLM=1`` (``scripts/test.sh``) turns a missing vLLM into a failure."""

import json
import os
from importlib import resources

import pytest

from rig_decode.config import RigConfig
from rig_decode.engine.engine import EngineOptions
from rig_decode.engine.runner_vllm import EventLoopThread, vllm_runner_on
from rig_decode.engine.vllm_api import engine_args_kwargs, load_vllm_api
from rig_decode.engine.vllm_logits import MarkerRules
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.models.embedded import is_pulled

from .test_exactness import PROMPTS, _script
from .test_remote import _engine

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
OPTIONS = {"plain": {}, "first-hop-and-cap": {"retrieve_first": True, "max_query_tokens": 6},
           "budget-of-one": {"max_iterations": 1}}
VLLM = {"max_model_len": 2048, "kv_cache_gib": 0.5}


@pytest.fixture(scope="module")
def api():
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("RIG_REQUIRE_VLLM") == "1":
            pytest.fail("RIG_REQUIRE_VLLM=1 but vLLM is not installed (./scripts/setup.sh --vllm)")
        pytest.skip("vLLM not installed (./scripts/setup.sh --vllm)")
    if not is_pulled(MODEL):
        pytest.fail("the embedded default model is not pulled (scripts/setup.sh)")
    return load_vllm_api()


@pytest.fixture(scope="module")
def local():
    """The in-process model: the embedded default with its adapter merged at load."""
    from rig_decode.models.loader import load_model

    return load_model(RigConfig().model)


def _cfg(logits_processor: bool) -> RigConfig:
    return RigConfig().updated(engine={"backend": "vllm", "vllm": {**VLLM, "logits_processor": logits_processor}})


@pytest.fixture(scope="module")
def engines(api):
    """``{logits_processor: (loop, AsyncLLM)}``, started on first use, shut down with the module."""
    started = {}

    def get(logits_processor: bool):
        if logits_processor not in started:
            if logits_processor:
                os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # as vllm_runner does for the processor
            args = api.AsyncEngineArgs(**engine_args_kwargs(_cfg(logits_processor), api))
            loop = EventLoopThread()

            async def start():
                return api.AsyncLLM.from_engine_args(args)

            started[logits_processor] = (loop, loop.run(start()))
        return started[logits_processor]

    yield get
    for loop, engine in started.values():
        async def stop(engine=engine):
            engine.shutdown(timeout=30)

        loop.run(stop(), timeout=60)
        loop.close()


def _runner(api, engines, tok, mode: str, logits_processor: bool, options: dict):
    """A runner on the shared engine, its prefix cache emptied: blocks an earlier test computed for the
    same rows would otherwise count as cached and hide what this run evaluates."""
    loop, engine = engines(logits_processor)
    assert loop.run(engine.reset_prefix_cache(), timeout=60)
    rules = None
    if logits_processor:
        opts = EngineOptions(**{"max_iterations": 3, **options})  # as test_remote._engine builds them
        rules = MarkerRules.from_tokenizer(tok, [tok.eos_token_id], opts.max_iterations, opts.max_query_tokens)
    return vllm_runner_on(engine, api, len(tok), mode=mode, context_limit=VLLM["max_model_len"], marker_rules=rules,
                      loop=loop, owns_loop=False, timeout_s=300)


def _generate(engine, tok, questions):
    """The rows as a session prompts them (the adapter's system prompt, the chat template), so the
    model writes on: a bare question makes the real model stop at once."""
    from rig_decode.prompt import build_prompt

    cfg = RigConfig()
    spec, system = MarkerSpec.from_style(cfg.rig.marker_style), cfg.system_prompt()
    seqs = [engine.new_sequence(build_prompt(tok, q, spec, system), seq_id=i) for i, q in enumerate(questions)]
    engine.generate(seqs)
    return seqs


_IN_PROCESS: dict[str, list] = {}


@pytest.mark.parametrize("logits_processor", [False, True], ids=["engine-rules", "with-processor"])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("mode", ["stream", "prefix"])
def test_real_vllm_gives_the_in_process_tokens_and_evaluates_only_new_tokens(api, engines, local, mode, name,
                                                                             logits_processor):
    model, tok = local
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    if name not in _IN_PROCESS:
        _IN_PROCESS[name] = _generate(_engine(model, tok, script, **OPTIONS[name]), tok, PROMPTS)
    expected = _IN_PROCESS[name]
    runner = _runner(api, engines, tok, mode, logits_processor, OPTIONS[name])
    try:
        out = _generate(_engine(model, tok, script, runner=runner, **OPTIONS[name]), tok, PROMPTS)
    finally:
        runner.close()
    block = engines(logits_processor)[1].vllm_config.cache_config.block_size
    hop_steps = set()
    for a, b in zip(expected, out):
        assert b.token_ids == a.token_ids and b.mask == a.mask
        assert b.trace.num_hops == a.trace.num_hops > 0
        for step in b.trace.retrieval_steps:
            if not step.evidence_tokens:
                continue
            hop_steps.add(step.position)
            info = step.info["server"]
            assert info["mode"] == mode
            if mode == "stream" and info["cache_n"] != info["num_cached_tokens"]:  # the session went on: the
                assert info["prompt_n"] == step.evidence_tokens + 1, info  # marker token and the evidence
            else:  # a new request (in stream mode: the script forced a token the model did not pick, which
                # ends a session): the prefix cache holds whole blocks, at most the partial last one again
                assert step.evidence_tokens + 1 <= info["prompt_n"] <= step.evidence_tokens + 1 + block, info
    assert len(hop_steps) > 1  # the rows hopped at different steps
    if name == "budget-of-one":
        assert all(s.trace.num_hops <= 1 for s in out)


def test_real_vllm_answers_the_demo_like_the_in_process_backend(api, local):
    """``rig demo --backend vllm``'s session: the adapter served merged, same answers and hop queries."""
    from rig_decode import RigSession

    questions = [q["question"] for q in
                 json.loads((resources.files("rig_decode") / "data" / "demo_questions.json").read_text())]
    model, tok = local
    cfg = RigConfig().updated(model={"max_tokens": 160})
    with RigSession(cfg, model=model, tokenizer=tok) as session:
        expected = session.ask_batch(questions)
    with RigSession(cfg.updated(engine={"backend": "vllm", "vllm": VLLM})) as session:
        runner = session.engine.runner
        got = session.ask_batch(questions)
    assert runner.engine is None  # the session shut its engine down
    hops = 0
    for (a_answer, a_trace), (b_answer, b_trace) in zip(expected, got):
        assert b_answer == a_answer
        assert [s.query for s in b_trace.retrieval_steps] == [s.query for s in a_trace.retrieval_steps]
        assert a_trace.num_hops >= 2
        hops += b_trace.num_hops
        for step in b_trace.retrieval_steps:  # the model wrote its markers: each hop went on in its session
            assert step.info["server"]["prompt_n"] == step.evidence_tokens + 1, step.info
    # vLLM decoded each stretch between hops on its own: one call per question and one per hop
    assert runner.calls == len(questions) + hops, (runner.calls, hops)
