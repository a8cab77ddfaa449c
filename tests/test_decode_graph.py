"""The decode step as one function of tensors (``models.decode_graph.DecodeGraph``), eager or
compiled with ``torch.compile(fullgraph=True)``.

Only decode steps (one token per row over a cache that holds tokens) go through it; every prefill
and splice stays on the HF path. So the splice == re-prefill invariant must hold whichever step
decodes: the spliced batch with ``decode_step`` graph or compiled gives exactly the tokens of the
re-prefilling reference engine on the HF path, with rows joining (a batch of two slots for three
requests), leaving and hopping mid-batch. ``fullgraph=True`` turns any graph break into an error,
so compiling the step on a model proves it has none.
"""

import sys

import pytest
import torch
from transformers import (GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from rig_decode.config import ConfigError, RigConfig
from rig_decode.engine import EngineOptions
from rig_decode.engine.runner_hf import HFModelRunner
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.models import decode_graph
from rig_decode.models.cpu_gemm import pack_linears, packing_available
from rig_decode.models.decode_graph import DecodeGraph, decode_step_for, uncompilable_reason, unsupported_reason
from rig_decode.models.weight_only import quantize_linears

from .helpers import ROOT, LogitRecorder, neighbour_paired_model, smollm3_one_layer, tiny_model
from .test_chunked_prefill import assert_splice_exact, run_engine
from .test_exactness import PROMPTS, _script

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every ``DecodeGraph`` compiles the same function (``DecodeGraph._step``), and Dynamo keeps at
    most ``recompile_limit`` (8) graphs of one function per process, across instances: each test
    starts from none, so the models compiled here do not add up."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_qwen2(vocab_size: int, seed: int = 0) -> Qwen2ForCausalLM:
    """A two-layer Qwen2: biased q/k/v projections (random biases, not HF's zero init) and grouped
    query attention (4 heads over 2 KV heads)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None
                proj.bias.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = 2
    return model


@pytest.fixture(scope="module")
def qwen2(tok):
    return tiny_qwen2(len(tok))


@pytest.fixture
def graph_calls(monkeypatch):
    """How many decode steps went through a ``DecodeGraph``."""
    calls = []
    call = DecodeGraph.__call__
    monkeypatch.setattr(DecodeGraph, "__call__", lambda self, *a: calls.append(self.compiled) or call(self, *a))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("step", ["graph", "compiled"])
def test_splice_equals_reprefill_with_the_decode_graph(model, qwen2, tok, graph_calls, monkeypatch, arch, step):
    """Three requests over two batch slots: the third joins when the second stops early; rows hop at
    different steps and finish at different times. Decoding through the graph (compiled: by
    Inductor, whole), the spliced batch equals the reference engine on the HF path, token for token,
    and every recorded step's logits equal a cache-free forward."""
    net = model if arch == "llama" else qwen2
    chunk = 16 if arch == "qwen2" else None  # and prefill in chunks, as the shipped config does
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    rec = LogitRecorder()
    joins, add_rows = [], HFModelRunner.add_rows

    def joining(self, prompts, *args, **kwargs):
        joins.append(self.batch_size)
        return add_rows(self, prompts, *args, **kwargs)

    monkeypatch.setattr(HFModelRunner, "add_rows", joining)
    spliced = run_engine(net, tok, PROMPTS, script, recorder=rec, decode_step=step, max_batch_size=2,
                         prefill_chunk_tokens=chunk)
    assert joins == [0, 1]  # the third request joined the running row
    assert len(graph_calls) > 50 and set(graph_calls) == {step == "compiled"}  # most steps decode
    assert_splice_exact(net, tok, PROMPTS, spliced, rec, decode_step="hf", max_batch_size=2)


def _greedy(logits):
    return logits.argmax(-1).tolist()


def _walk(runner, prompts, evidence, joining):
    """Greedy decoding through a schedule that moves every row: decode, a row joins, decode, a row
    leaves, a row splices an evidence block beside a decoding row, decode. Returns every step's
    tokens and logits."""
    seen = []

    def step(feed):
        logits = runner.step(feed)
        seen.append((_greedy(logits), logits))
        return seen[-1][0]

    runner.reset(0)
    nxt = step(runner.add_rows(prompts))
    for _ in range(3):
        nxt = step([[t] for t in nxt])
    rest = runner.add_rows([joining])[0]
    nxt = step([[nxt[0]], [nxt[1]], rest])  # joins beside two decoding rows
    for _ in range(3):
        nxt = step([[t] for t in nxt])
    runner.select([0, 2])  # the middle row leaves
    nxt = [nxt[0], nxt[2]]
    nxt = step([[t] for t in nxt])
    nxt = step([[nxt[0], *evidence], [nxt[1]]])  # a splice beside a decode
    for _ in range(3):
        nxt = step([[t] for t in nxt])
    return seen


def _compare_walks(model, prompts, evidence, joining, atol):
    """The HF path's greedy walk against the fullgraph-compiled step's (Dynamo with the eager
    backend: the same capture, no code generation)."""
    reference = _walk(HFModelRunner(model, pad_id=0, decode_step="hf"), prompts, evidence, joining)
    runner = HFModelRunner(model, pad_id=0, decode_step="hf")
    runner.graph = DecodeGraph(model, backend="eager")
    assert runner.graph.compiled
    compiled = _walk(runner, prompts, evidence, joining)
    assert [t for t, _ in compiled] == [t for t, _ in reference]
    for (_, got), (_, want) in zip(compiled, reference):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.real_model
def test_default_model_decode_step_compiles_whole_and_decodes_like_hf(real, graph_calls):
    """The embedded default (SmolLM2, fp32, plain ``nn.Linear``: not packed for oneDNN) compiles
    with ``fullgraph=True`` (any graph break raises), and its greedy tokens equal the HF path's
    through a row joining, a row leaving and a splice."""
    model, tok = real
    assert unsupported_reason(model) is None and uncompilable_reason(model) is None
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"]
               for q in ("Which release fixed error E1234?", "Who approved release 4.2.1?")]
    joining = tok.encode("Name the capital of France.")
    evidence = tok.encode("\n<evidence>\n[1] Release 4.2.1 fixed error E1234; Priya Raman approved it.\n</evidence>\n")
    _compare_walks(model, prompts, evidence, joining, atol=1e-3)  # measured 5e-5
    assert graph_calls.count(True) == 10  # every decode step of the walk, compiled


def test_random_qwen2_shapes_decode_step_compiles_whole_and_decodes_like_hf(graph_calls):
    """The benchmarks' random Qwen2 (``bench/random_qwen.py``, ``small``: three layers, biased
    q/k/v, GQA, head_dim 32) compiles whole, and decodes as the HF path does."""
    sys.path.append(str(ROOT / "bench"))
    import random_qwen

    model = random_qwen.build_model(random_qwen.SHAPES["small"], torch.device("cpu"), torch.float32)
    assert unsupported_reason(model) is None
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (21, 9)]
    evidence, joining = (torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (17, 12))
    _compare_walks(model, prompts, evidence, joining, atol=1e-5)  # measured 5e-7
    assert graph_calls.count(True) == 10


def test_an_int8_model_decode_step_compiles_whole_and_decodes_like_hf(graph_calls):
    """Int8 weight-only layers (one ``aten._weight_int8pack_mm`` call each, what ``auto`` compiles
    for a quantized model) sit inside the fullgraph capture. Logits: measured equal here, compared
    within the int8 kernel's bf16 rounding, which may depend on the rows in a call (the HF path has
    the batch's rows, the graph the buffers' spare rows too)."""
    model = tiny_model(600)
    quantize_linears(model, "int8")
    assert decode_step_for(model, "auto") == "compiled"
    gen = torch.Generator().manual_seed(32)
    prompts = [torch.randint(3, 600, (n,), generator=gen).tolist() for n in (21, 9)]
    evidence, joining = (torch.randint(3, 600, (n,), generator=gen).tolist() for n in (17, 12))
    _compare_walks(model, prompts, evidence, joining, atol=0.05)
    assert graph_calls.count(True) == 10


class _BreakingMLP(torch.nn.Module):
    """An MLP with a graph break: an explicit one, or a branch on a value read back to the host."""

    def __init__(self, mlp, how: str):
        super().__init__()
        self.mlp, self.how = mlp, how

    def forward(self, x):
        if self.how == "graph_break":
            torch._dynamo.graph_break()
        elif x.abs().max().item() > 1e9:
            return x
        return self.mlp(x)


@pytest.mark.parametrize("how, error", [("graph_break", torch._dynamo.exc.Unsupported),
                                        ("host_branch", torch._dynamo.exc.TorchDynamoException)])
def test_a_graph_break_in_the_decode_step_is_an_error(how, error):
    """``fullgraph=True``: a module in the step that breaks the graph makes the compiled step raise
    (rather than silently run part of the step eagerly); the eager graph still runs it."""
    model = tiny_model(600)
    model.model.layers[1].mlp = _BreakingMLP(model.model.layers[1].mlp, how)
    runner = HFModelRunner(model, pad_id=0, decode_step="hf")
    runner.prefill([[5, 6, 7], [8, 9]])
    runner.graph = DecodeGraph(model, backend="eager")
    with pytest.raises(error):
        runner.step([[1], [2]])
    eager = HFModelRunner(model, pad_id=0, decode_step="graph")
    eager.prefill([[5, 6, 7], [8, 9]])
    reference = HFModelRunner(model, pad_id=0, decode_step="hf")
    reference.prefill([[5, 6, 7], [8, 9]])
    torch.testing.assert_close(eager.step([[1], [2]]), reference.step([[1], [2]]), atol=1e-5, rtol=0)


def test_decode_step_choices():
    """``auto``: hf for an fp32 model on CPU, compiled for a weight-only quantized one; a named
    choice is kept."""
    plain = tiny_model(600)
    assert decode_step_for(plain, "auto") == "hf"
    for choice in ("hf", "graph", "compiled"):
        assert decode_step_for(plain, choice) == choice
    for bits in ("int8", "int4"):
        quantized = tiny_model(512)  # int4 packs output widths in multiples of 16
        quantize_linears(quantized, bits)
        assert decode_step_for(quantized, "auto") == "compiled", bits
    with pytest.raises(ValueError, match="decode_step must be auto, hf, graph or compiled, got 'fast'"):
        decode_step_for(plain, "fast")
    runner = HFModelRunner(plain, pad_id=0, decode_step="graph")
    assert runner.decode_step == "graph" and runner.graph is not None and not runner.graph.compiled
    assert HFModelRunner(plain, pad_id=0, decode_step="auto").graph is None


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear packing")
def test_packed_weights_are_refused_for_the_compiled_step_only():
    """oneDNN-packed weights are opaque to torch.compile: ``compiled`` is refused with the way out,
    ``auto`` falls back to hf, and the eager graph runs them, computing what the HF path computes."""
    packed = tiny_model(600)
    assert pack_linears(packed) > 0
    assert "cpu_gemm: torch" in uncompilable_reason(packed)
    with pytest.raises(ValueError, match="decode_step compiled: its linear weights are packed for oneDNN .*"
                                         "model.cpu_gemm: torch"):
        decode_step_for(packed, "compiled")
    with pytest.raises(ValueError, match="no compiled decode step for this model: its linear weights are packed"):
        DecodeGraph(packed)
    with pytest.raises(ValueError, match="packed for oneDNN"):
        HFModelRunner(packed, pad_id=0, decode_step="compiled")
    assert decode_step_for(packed, "auto") == "hf"
    runner = HFModelRunner(packed, pad_id=0, decode_step="graph")
    reference = HFModelRunner(tiny_model(600), pad_id=0, decode_step="hf")
    for r in (runner, reference):
        r.prefill([[5, 6, 7, 8], [9, 10]])
    for feed in ([[1], [2]], [[3], [4]]):
        torch.testing.assert_close(runner.step(feed), reference.step(feed), atol=1e-4, rtol=0)


def test_a_model_the_graph_cannot_run_is_refused_by_name_and_left_on_hf_by_auto():
    """A sliding window is not what ``DecodeGraph`` computes: ``graph``/``compiled`` name the reason,
    ``auto`` keeps the HF path."""
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=64)).eval()
    assert unsupported_reason(mistral) == "sliding-window attention"
    for choice in ("graph", "compiled"):
        with pytest.raises(ValueError, match=f"decode_step {choice}: sliding-window attention"):
            decode_step_for(mistral, choice)
    assert decode_step_for(mistral, "auto") == "hf"
    with pytest.raises(ValueError, match="no decode step for this model: sliding-window attention"):
        DecodeGraph(mistral, compile=False)


def _accepted_but_different(kind):
    torch.manual_seed(0)
    if kind == "smollm3_nope":  # a layer without rotary position (SmolLM3's NoPE layers)
        return smollm3_one_layer(600, rope=False)
    if kind == "helium":  # rotates the pairs (2i, 2i + 1), not (i, i + d/2)
        return neighbour_paired_model("helium", 600)
    # Granite scales the embeddings, the residual branches, the attention and the logits
    return GraniteForCausalLM(GraniteConfig(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=12.0,
                                            residual_multiplier=0.22, attention_multiplier=0.0078125,
                                            logits_scaling=8.0, pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2)).eval()


@pytest.mark.parametrize("kind", ["smollm3_nope", "helium", "granite"])
def test_a_model_whose_layers_the_graph_does_not_compute_keeps_the_hf_path(kind):
    """Llama-shaped modules are not enough: NoPE layers, interleaved rotary pairs or Granite's
    multipliers would decode wrongly through the graph, so it refuses them by model type, ``auto``
    picks ``hf``, and asking for the graph by name is an error that says why."""
    model = _accepted_but_different(kind)
    assert "model type" in unsupported_reason(model)
    assert HFModelRunner(model, pad_id=0, decode_step="auto").graph is None
    with pytest.raises(ValueError, match="model type"):
        HFModelRunner(model, pad_id=0, decode_step="graph")


def test_a_process_compiles_the_decode_step_of_many_models():
    """A process (an eval over models, a test session) builds compiled steps for nine small models
    of different shapes, one after another."""
    for i in range(9):
        torch.manual_seed(i)
        heads = 2 + i % 5
        cfg = LlamaConfig(vocab_size=100, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=heads if i < 5 else 1, head_dim=16)
        model = LlamaForCausalLM(cfg).eval()
        runner = HFModelRunner(model, pad_id=0)
        runner.graph = DecodeGraph(model, backend="eager")
        runner.prefill([[5, 6, 7], [8, 9]])
        runner.step([[1], [2]])


def test_engine_options_validate_the_decode_step_and_the_chunk():
    for step in ("auto", "hf", "graph", "compiled"):
        assert EngineOptions(decode_step=step).decode_step == step
    assert EngineOptions().decode_step == "auto" and EngineOptions().prefill_chunk_tokens is None
    with pytest.raises(ValueError, match="decode_step must be one of auto, hf, graph, compiled, got 'cuda_graph'"):
        EngineOptions(decode_step="cuda_graph")
    assert EngineOptions(prefill_chunk_tokens=1).prefill_chunk_tokens == 1
    for bad in (0, -512):
        with pytest.raises(ValueError, match="prefill_chunk_tokens must be at least 1"):
            EngineOptions(prefill_chunk_tokens=bad)


def test_config_keys_reach_the_engine_options():
    from rig_decode.session import engine_options

    default = RigConfig()
    assert (default.engine.decode_step, default.engine.prefill_chunk_tokens) == ("auto", 512)
    cfg = RigConfig.from_dict({"engine": {"decode_step": "compiled", "prefill_chunk_tokens": 64}})
    opts = engine_options(cfg)
    assert (opts.decode_step, opts.prefill_chunk_tokens) == ("compiled", 64)
    unbounded = engine_options(RigConfig.from_dict({"engine": {"prefill_chunk_tokens": None}}))
    assert unbounded.prefill_chunk_tokens is None
    with pytest.raises(ConfigError, match="engine.decode_step"):
        RigConfig.from_dict({"engine": {"decode_step": "cuda_graph"}})
    with pytest.raises(ConfigError, match="engine.prefill_chunk_tokens"):
        RigConfig.from_dict({"engine": {"prefill_chunk_tokens": 0}})


def test_the_decode_graph_module_names_its_rope_types():
    """The rope types ``DecodeGraph`` computes once at load: a model with another is refused."""
    model = tiny_model(600)
    assert model.model.rotary_emb.rope_type in decode_graph.STATIC_ROPE
    model.model.rotary_emb.rope_type = "dynamic"
    assert unsupported_reason(model) == "rotary embedding 'dynamic' is not computed once at load time"
