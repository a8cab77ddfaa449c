"""Weight-only quantization (``models.weight_only``: int8 per channel, int4 per group) and the splice
under every quantization the loader offers (int8, int4, bitsandbytes nf4).

Quantized weights change what the model computes, not the invariant: the spliced batch must give
exactly the tokens of the reference engine that re-prefills after every hop, on the same quantized
model. Logits are compared with a cache-free forward at a tolerance per quantization: the kernels
take bf16 activations, and the int8 kernel's rounding depends on how many rows share the call.
"""

import pytest
import torch
from torch import nn

from rig_decode.config import ModelConfig
from rig_decode.engine.runner_hf import HFModelRunner
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.models.decode_graph import DecodeGraph, decode_step_for
from rig_decode.models.loader import load_model
from rig_decode.models.weight_only import INT4_GROUP, Int4Linear, Int8Linear, quantize_linears

from .helpers import LogitRecorder, tiny_model
from .test_chunked_prefill import run_engine
from .test_exactness import PROMPTS, _full_forward_logits, _script

pytestmark = pytest.mark.usefixtures("one_thread")

LINEAR_TYPES = {"int8": Int8Linear, "int4": Int4Linear}


def _linear(n_in: int, n_out: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.02)
        if bias:
            linear.bias.normal_(0.0, 0.02)
    return linear


def _relative_error(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


# Measured over seeds 0-4 and these widths: int8 0.62-0.80 %, int4 (groups of 32..128) 7.3-10.3 %.
ERROR_BOUND = {"int8": 0.015, "int4": 0.15}


@pytest.mark.parametrize("bits", ["int8", "int4"])
@pytest.mark.parametrize("n_in, n_out", [(256, 64), (96, 48), (512, 32)])
def test_quantized_linear_is_close_to_the_linear(bits, n_in, n_out):
    for seed in range(3):
        linear = _linear(n_in, n_out, bias=True, seed=seed)
        x = torch.randn(2, 7, n_in)
        with torch.no_grad():
            err = _relative_error(LINEAR_TYPES[bits](linear)(x), linear(x))
        assert err <= ERROR_BOUND[bits], (seed, err)


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_quantized_linear_computes_its_rounded_weights(bits):
    """The kernel's conventions (int8: one scale per output channel; int4: a scale and a zero
    point per group, with the ``(q - 8) * scale + zero`` the kernels use) reproduced by hand: the
    layer's output is the bf16 input times the rounded weights, up to bf16 rounding (measured
    0.16 % and 0.22 %), far below the quantization error itself."""
    linear = _linear(256, 64, bias=False, seed=4)
    w = linear.weight.detach().float()
    if bits == "int8":
        scale = w.abs().amax(1) / 127
        rounded = (w / scale[:, None]).round() * scale.bfloat16().float()[:, None]
    else:
        groups = w.view(64, 256 // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        step = (hi - lo) / 15
        rounded = (((groups - lo[..., None]) / step[..., None]).round().clamp(0, 15) * step[..., None]
                   + lo[..., None]).view(64, 256)
    x = torch.randn(5, 256)
    with torch.no_grad():
        got = LINEAR_TYPES[bits](linear)(x)
    assert _relative_error(got, x.bfloat16().float() @ rounded.T) <= 0.005


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_bias_shapes_and_dtypes(bits):
    """The bias is added after the matmul, in full (the same layer without it differs by exactly
    the bias); any leading shape ``[*, in]`` maps to ``[*, out]``; the output has the model's dtype
    (fp32 or bf16) although the kernels compute in bf16."""
    biased = _linear(128, 48, bias=True, seed=1)
    plain = nn.Linear(128, 48, bias=False)
    plain.weight = biased.weight
    with_bias, without = LINEAR_TYPES[bits](biased), LINEAR_TYPES[bits](plain)
    assert with_bias.bias is not None and without.bias is None
    with torch.no_grad():
        for shape in ((128,), (3, 128), (2, 3, 128), (1, 1, 1, 128)):
            x = torch.randn(shape)
            y = with_bias(x)
            assert y.shape == (*shape[:-1], 48) and y.dtype == torch.float32
            torch.testing.assert_close(y - without(x), biased.bias.detach().expand_as(y), atol=1e-6, rtol=0)
        half = LINEAR_TYPES[bits](_linear(128, 48, bias=True, seed=1).to(torch.bfloat16))
        assert half(torch.randn(4, 128, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_int4_groups_fit_the_input_width():
    assert Int4Linear(_linear(256, 32, False, 0)).group == INT4_GROUP
    assert Int4Linear(_linear(96, 32, False, 0)).group == 32  # the widest power of two dividing 96
    with pytest.raises(ValueError, match="int4 needs an input width divisible by 32, got 80"):
        Int4Linear(_linear(80, 32, False, 0))


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_quantize_linears_replaces_every_linear_and_unties_the_head(bits):
    """Every plain linear (7 per decoder layer, and the LM head) is replaced; a head tied to the
    embeddings gets its own quantized copy, the config says it is no longer tied, and the
    embeddings and norms stay as they were."""
    model = tiny_model(512)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    embeddings = model.model.embed_tokens.weight.detach().clone()
    norms = [m.weight.detach().clone() for m in model.modules() if "RMSNorm" in type(m).__name__]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert quantize_linears(model, bits) == 2 * 7 + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, LINEAR_TYPES[bits]) and model.config.tie_word_embeddings is False
    assert type(model.model.embed_tokens) is nn.Embedding
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
    after_norms = [m.weight for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert all(torch.equal(a, b) for a, b in zip(after_norms, norms)) and len(norms) == 5
    with torch.no_grad():
        after = model(input_ids=ids).logits
    # A random model this small (weights of std 0.2) magnifies the rounding: measured 3.2 % (int8) and
    # 54 % (int4) of the logits; each layer's own error is bounded above.
    assert after.dtype == torch.float32 and _relative_error(after, before) < (0.06 if bits == "int8" else 1.0)
    assert quantize_linears(model, bits) == 0  # nothing plain is left
    with pytest.raises(ValueError, match=r"weight-only quantization is one of \('int8', 'int4'\), got 'nf4'"):
        quantize_linears(tiny_model(512), "nf4")


def test_int4_quantizes_a_head_whose_vocabulary_is_not_a_multiple_of_16():
    model = tiny_model(600 + 2)  # e.g. two marker tokens added to a vocabulary
    quantize_linears(model, "int4")
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 602)


# -- the splice under each quantization, through the loader ------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    """The tiny model saved as a model directory (its vocabulary padded to a multiple of 16, as
    int4 packing needs), with the tiny tokenizer."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model(-(-len(tok) // 16) * 16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _load(folder, quantization):
    if quantization == "nf4":
        pytest.importorskip("bitsandbytes", reason="quantization: nf4 needs bitsandbytes")
    return load_model(ModelConfig(name=str(folder), quantization=quantization, device="cpu", dtype="float32",
                                  adapter=None, cpu_gemm="torch"))


# Cache-free forward vs the spliced batch, worst logit difference measured (logits span about +-10):
# int8 0.047 (its kernel rounds to bf16 differently for different numbers of rows), int4 0.0,
# nf4 0.028 (bf16 compute).
LOGIT_TOLERANCE = {"int8": 0.15, "int4": 1e-4, "nf4": 0.1}


@pytest.mark.parametrize("quantization, step", [("int8", "graph"), ("int4", "graph"), ("nf4", "hf")])
def test_splice_equals_reprefill_under_each_quantization(tiny_dir, quantization, step, monkeypatch):
    """The exactness test on the quantized tiny model: the spliced batch gives exactly the tokens
    and masks of the re-prefilling reference engine (HF decode step), and each row alone (HF decode
    step) gives its tokens in the batch. The decode step: ``auto`` (int8: compiled by Inductor, what an int8 model
    on CPU gets), the eager graph (int4), the HF path (nf4)."""
    model, tok = _load(tiny_dir, quantization)
    kinds = (nn.Linear, Int8Linear, Int4Linear)
    linears = [type(m).__name__ for m in model.model.layers.modules() if isinstance(m, kinds)]
    want = {"int8": "Int8Linear", "int4": "Int4Linear", "nf4": "Linear4bit"}[quantization]
    assert linears and set(linears) == {want}, set(linears)
    assert decode_step_for(model, "auto") == ("hf" if quantization == "nf4" else "compiled")
    graph_calls, call = [], DecodeGraph.__call__
    monkeypatch.setattr(DecodeGraph, "__call__", lambda self, *a: graph_calls.append(self.compiled) or call(self, *a))
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    rec = LogitRecorder()
    spliced = run_engine(model, tok, PROMPTS, script, recorder=rec, decode_step=step)
    assert all(s.trace.num_hops >= 1 for s in spliced) and spliced[2].trace.num_hops == 3
    if step == "hf":
        assert not graph_calls
    else:  # most steps decode, all of them through the (eager) graph
        assert len(graph_calls) > 50 and set(graph_calls) == {False}
    after_splice = {(s.seq_id, st.position + st.evidence_tokens) for s in spliced for st in s.trace.retrieval_steps}
    assert after_splice <= set(rec.logits)
    worst = max((logits - _full_forward_logits(model, spliced[sid].token_ids[:n])).abs().max().item()
                for (sid, n), logits in rec.logits.items())
    assert worst <= LOGIT_TOLERANCE[quantization], worst
    reference = run_engine(model, tok, PROMPTS, script, reprefill=True, decode_step="hf")
    for a, b in zip(spliced, reference):
        assert a.token_ids == b.token_ids
        assert a.mask == b.mask
    for i, s in enumerate(spliced):
        alone = run_engine(model, tok, [PROMPTS[i]], script, seq_ids=[i], decode_step="hf")[0]
        assert alone.token_ids == s.token_ids


@pytest.mark.real_model
def test_default_model_in_int8_answers_as_in_fp32(real):
    """The embedded default loaded with ``quantization: int8`` (its own weights: no adapter, as the
    fp32 fixture) decodes the same greedy answer as fp32 to a short question."""
    fp32, tok = real
    int8, tok8 = load_model(ModelConfig(quantization="int8", device="cpu", adapter=None))
    assert isinstance(int8.lm_head, Int8Linear) and len(tok8) == len(tok)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)["input_ids"]
    answers = []
    for model in (fp32, int8):
        runner = HFModelRunner(model, pad_id=tok.pad_token_id or 0, decode_step="hf")
        logits, out = runner.prefill([ids]), []
        for _ in range(12):
            out.append(int(logits[0].argmax()))
            if out[-1] == tok.eos_token_id:
                break
            logits = runner.step([[out[-1]]])
        answers.append(out)
    assert "Paris" in tok.decode(answers[0])
    assert answers[1] == answers[0], [tok.decode(a) for a in answers]
