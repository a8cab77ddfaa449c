"""Chunked prefill: every forward the runner does takes at most ``prefill_chunk`` tokens, and the
splice stays exact.

Prompts, evidence blocks, rows joining and the shared prompt prefix are fed in forwards of at most
``prefill_chunk`` tokens (``HFModelRunner._forward_chunked``). Chunking changes where the forwards
cut the tokens, never what each token attends to, so the spliced batch must still give exactly the
tokens of the reference engine that re-prefills after every hop (unchunked), and every row's
logits must equal a cache-free forward of its tokens.
"""

import random
from contextlib import contextmanager

import pytest
import torch

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.runner_hf import HFModelRunner
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ForceScript, LogitRecorder, ScriptedRetriever, one_layer_model, random_schedule, tiny_model
from .test_exactness import PROMPTS, SHARED, _full_forward_logits, _script

pytestmark = pytest.mark.usefixtures("one_thread")


@contextmanager
def forward_shapes(model):
    """The ``input_ids`` shape of every forward through ``model`` inside (a hook on the embeddings:
    every forward the runner does, whichever path, embeds its tokens first)."""
    shapes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    try:
        yield shapes
    finally:
        hook.remove()


def run_engine(model, tok, prompts, script, *, reprefill=False, recorder=None, seq_ids=None, **options):
    opts = EngineOptions(max_iterations=3, max_new_tokens=70, evidence_token_budget=64, top_k=2, reprefill=reprefill,
                         **options)
    extra = ([recorder] if recorder else []) + [ForceScript(script)]
    engine = RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=extra)
    seq_ids = seq_ids or list(range(len(prompts)))
    seqs = [engine.new_sequence(tok.encode(p), seq_id=i) for i, p in zip(seq_ids, prompts)]
    return engine.generate(seqs)


def assert_splice_exact(model, tok, prompts, spliced, recorder, *, atol=1e-4, **reference_options):
    """The spliced run's recorded logits against cache-free forwards, its tokens and masks against
    the re-prefilling reference engine's (``reference_options``: how that one runs)."""
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    assert [s.trace.num_hops for s in spliced] == [2, 1, 3]  # the scripted hops happened
    after_splice = {(s.seq_id, st.position + st.evidence_tokens) for s in spliced for st in s.trace.retrieval_steps}
    assert after_splice <= set(recorder.logits)  # the steps right after each splice are among those checked
    worst = max((logits - _full_forward_logits(model, spliced[sid].token_ids[:n])).abs().max().item()
                for (sid, n), logits in recorder.logits.items())
    assert worst <= atol, worst
    reference = run_engine(model, tok, prompts, script, reprefill=True, **reference_options)
    for a, b in zip(spliced, reference):
        assert a.token_ids == b.token_ids
        assert a.mask == b.mask


@pytest.mark.parametrize("chunk", [5, 16])
@pytest.mark.parametrize("shared", ["", SHARED])
def test_chunked_splice_equals_reprefill(model, tok, chunk, shared):
    """Chunks smaller than every prompt and every evidence block (64 tokens), with and without a
    shared prompt prefix (computed once, itself in chunks): the spliced batch is exact, and no
    forward feeds a row more than ``chunk`` tokens."""
    prompts = [shared + p for p in PROMPTS]
    assert max(len(tok.encode(p)) for p in prompts) > chunk
    assert not shared or len(tok.encode(shared)) > 2 * chunk
    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    rec = LogitRecorder()
    with forward_shapes(model) as shapes:
        spliced = run_engine(model, tok, prompts, script, recorder=rec, prefill_chunk_tokens=chunk, decode_step="hf")
    assert max(s[-1] for s in shapes) == chunk  # chunks were cut, and none is wider than the bound
    assert max(st.evidence_tokens for s in spliced for st in s.trace.retrieval_steps) > chunk
    assert_splice_exact(model, tok, prompts, spliced, rec, prefill_chunk_tokens=None, decode_step="hf")


@pytest.fixture(scope="module")
def wide():
    """A tiny model over ids 0..599 (the runner tests feed random ids, no tokenizer)."""
    return tiny_model(600)


def _prompts(gen, lengths):
    return [torch.randint(3, 600, (n,), generator=gen).tolist() for n in lengths]


def test_every_forward_of_a_ragged_step_feeds_at_most_the_chunk(wide):
    model = wide
    """A running batch: one row splices a long block, one decodes, one is parked, one joins alone
    with a long prompt (which becomes the cached prefix); then its follow-up joins. Every forward
    is packed ``[1, T]`` with ``T <= chunk`` and every fed row's logits equal a fresh forward."""
    gen = torch.Generator().manual_seed(21)
    chunk = 7
    shared = _prompts(gen, [30])[0]
    rows = [shared + p for p in _prompts(gen, [4, 9, 2])]
    runner = HFModelRunner(model, pad_id=0, prefill_chunk=chunk)
    with forward_shapes(model) as shapes:
        runner.prefill(rows)  # the shared prefix (>= 16 tokens) is computed once, in chunks
    assert runner._prefix[0] == shared
    assert shapes[:5] == [(1, 7)] * 4 + [(1, 2)]  # the 30 shared tokens, then the rows' own tokens
    joining = _prompts(gen, [19])[0]
    rest = runner.add_rows([joining])
    feed = [_prompts(gen, [23])[0], [11], [], rest[0]]
    with forward_shapes(model) as shapes:
        logits = runner.step(feed)
    assert all(len(s) == 2 and s[0] == 1 and s[1] <= chunk for s in shapes), shapes
    assert sum(s[1] for s in shapes) == 23 + 1 + 19
    tokens = [r + f for r, f in zip(rows, feed)] + [joining]
    for i in (0, 1, 3):
        torch.testing.assert_close(logits[i], _full_forward_logits(model, tokens[i]), atol=1e-4, rtol=1e-4)
    # The lone joining prompt, fed across chunks, is now the cached prefix: a follow-up extending it
    # (its next turn) is seeded with all of it, and its new tokens go in chunks.
    assert runner._prefix[0] == joining
    follow = joining + _prompts(gen, [17])[0]
    rest = runner.add_rows([follow])
    assert rest == [follow[19:]]
    with forward_shapes(model) as shapes:
        logits = runner.step([[5], [6], [], [7], rest[0]])
    assert all(s[-1] <= chunk for s in shapes) and len(shapes) == 3, shapes
    torch.testing.assert_close(logits[4], _full_forward_logits(model, follow), atol=1e-4, rtol=1e-4)


def test_a_batchs_first_prompts_compute_at_most_the_chunk(wide):
    """The chunk bounds the activations of a forward: the positions it computes, padding included."""
    model = wide
    gen = torch.Generator().manual_seed(22)
    chunk = 5
    runner = HFModelRunner(model, pad_id=0, prefill_chunk=chunk)
    with forward_shapes(model) as shapes:
        runner.prefill(_prompts(gen, [12, 3, 7]))
    assert max(s[0] * s[1] for s in shapes) <= chunk, shapes


@pytest.mark.parametrize("chunk", [1, 4])
def test_random_joins_steps_evictions_and_leaves_stay_exact_in_chunks(chunk):
    """Chunks as small as one token: a row's tokens are split across forwards, and rows share a
    forward with another row's first or last tokens."""
    model = one_layer_model(600)
    runner = HFModelRunner(model, pad_id=0, prefill_chunk=chunk)
    with forward_shapes(model) as shapes:
        kinds = random_schedule(one_layer_model(600), runner, random.Random(6), moves=50,
                                feed_sizes=[0, 1, 1, 1, 1, 1, 9])
    assert min(kinds.values()) >= 3, kinds
    assert max(s[-1] for s in shapes) == chunk


def test_chunked_logits_equal_unchunked_on_a_deep_model():
    """On a four-layer model (KV deep in the stack depends on every earlier token): a batch's
    prompts, then a splice beside a decode, give the same logits in chunks of 3 as in one forward."""
    model = tiny_model(600, seed=3, layers=4)
    gen = torch.Generator().manual_seed(23)
    prompts, block = _prompts(gen, [26, 11]), _prompts(gen, [14])[0]
    out = {}
    for chunk in (None, 3):
        runner = HFModelRunner(model, pad_id=0, prefill_chunk=chunk)
        first = runner.prefill(prompts)
        out[chunk] = first, runner.step([block, [9]]), runner.step([[4], [5]])
    for got, want in zip(out[3], out[None]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_bad_chunk_is_refused():
    model = one_layer_model(600)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="prefill_chunk must be at least 1"):
            HFModelRunner(model, pad_id=0, prefill_chunk=bad)


def test_reselecting_every_staged_token_in_chunks_is_the_exact_splice():
    """Zero-prefill with ``deviation`` selection and a block longer than the chunk: with every staged
    token reselected, the row computes exactly what feeding the block does (as unchunked:
    ``test_zero_prefill.test_reselected_tokens_match_the_measured_variant``)."""
    from rig_decode.kernels.chunk_kv import ChunkKVStore

    deep = tiny_model(600, seed=7, layers=4)
    gen = torch.Generator().manual_seed(1)
    context, block = _prompts(gen, [23, 19])
    exact = HFModelRunner(deep, pad_id=0)
    exact.prefill([context])
    want = exact.step([block])[0]
    runner = HFModelRunner(deep, pad_id=0, prefill_chunk=8)
    runner.prefill([context[:-1]])
    staged = {0: ChunkKVStore(deep).block_kv(block, [4, 6, 5, 4], len(block) - 1)}
    got = runner.step([[context[-1], *block]], staged=staged, reselect={0: len(block) - 1})[0]
    assert runner.lengths == [len(context) + len(block)]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
