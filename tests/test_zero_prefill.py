"""Zero-prefill evidence: per-piece KV computed once, alone, copied into the cache at hop time.

With one decoder layer a piece's KV does not depend on what precedes it, so zero-prefill must give
exactly the exact splice's tokens and logits: that checks the assembly (pieces, shifts, the
row's positions, the recomputed tail). On a deeper model it is an approximation; the tests check its
bookkeeping, the store's reuse and its byte bound."""

import pytest
import torch

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.runner_hf import HFModelRunner
from rig_decode.evidence import EvidenceFormatter
from rig_decode.kernels.chunk_kv import ChunkKVStore
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.retrieval.base import Hit

from .helpers import ForceScript, ScriptedRetriever, one_layer_model
from .test_exactness import PROMPTS, _script
from .test_summary import KeptRecorder


def _run(model, tok, *, zero_prefill, recorder=None, recompute=0.1, engine=None):
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    opts = EngineOptions(max_iterations=3, max_new_tokens=70, evidence_token_budget=64, top_k=2,
                         zero_prefill=zero_prefill, zero_prefill_recompute=recompute)
    extra = ([recorder] if recorder else []) + [ForceScript(_script(vocab, tok.eos_token_id))]
    engine = engine or RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=extra)
    seqs = [engine.new_sequence(tok.encode(p), seq_id=i) for i, p in enumerate(PROMPTS)]
    return engine.generate(seqs), engine


@pytest.fixture(scope="module")
def one_layer(tok):
    return one_layer_model(len(tok), seed=2)


def test_zero_prefill_is_exact_on_one_layer(one_layer, tok):
    rec = KeptRecorder()
    zero, engine = _run(one_layer, tok, zero_prefill=True, recorder=rec)
    exact, _ = _run(one_layer, tok, zero_prefill=False)
    assert [s.trace.num_hops for s in zero] == [2, 1, 3]
    for s in zero:
        for st in s.trace.retrieval_steps:
            zp = st.info["zero_prefill"]
            assert zp["reused_tokens"] + zp["recomputed_tokens"] == st.evidence_tokens
            assert zp["reused_tokens"] > 0 and zp["recomputed_tokens"] >= 1
    assert rec.worst_error(one_layer) <= 2e-4
    assert [s.token_ids for s in zero] == [s.token_ids for s in exact]
    assert engine.chunks.hits > 0  # the evidence head and tail recur on every hop


def test_zero_prefill_on_a_deep_model_runs_and_reuses_pieces(model, tok):
    seqs, engine = _run(model, tok, zero_prefill=True)
    assert [s.trace.num_hops for s in seqs][:2] == [2, 1]
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    misses = engine.chunks.misses
    _run(model, tok, zero_prefill=True, engine=engine)  # same questions again: same pieces
    assert engine.chunks.misses - misses <= 3 and engine.chunks.hits > misses


def test_full_recompute_stages_nothing(model, tok):
    seqs, _ = _run(model, tok, zero_prefill=True, recompute=1.0)
    exact, _ = _run(model, tok, zero_prefill=False)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in exact]
    assert all("zero_prefill" not in st.info for s in seqs for st in s.trace.retrieval_steps)


def test_block_kv_matches_pieces_and_store_is_bounded(model, tok):
    fmt = EvidenceFormatter(tok, 64)
    hits = [Hit("a", "Release 4.2.1 fixed error E1234.", 1.0), Hit("b", "Priya Raman approved it.", 0.9)]
    block = fmt.render_block(hits, 1)
    assert sum(block.segments) == len(block.token_ids) and len(block.segments) == 4
    store = ChunkKVStore(model)
    kv, shifts = store.block_kv(block.token_ids, block.segments, len(block.token_ids) - 3)
    assert kv[0][0].shape[2] == len(block.token_ids) - 3 == shifts.numel()
    assert shifts.device.type == "cpu"  # the runner adds the row's length on the host, no device sync
    starts = [0, *torch.tensor(block.segments).cumsum(0).tolist()[:-1]]
    assert sorted(set(shifts.tolist())) == [float(s) for s in starts]  # each piece shifted by its offset
    one = sum(k.nbytes + v.nbytes for k, v in store.get(block.token_ids[: block.segments[0]]))
    small = ChunkKVStore(model, max_bytes=one)
    small.get(block.token_ids[: block.segments[0]])
    small.get(block.token_ids[: block.segments[0]])
    assert (small.hits, len(small)) == (1, 1)
    small.get(block.token_ids[-block.segments[-1]:])
    assert len(small) == 1 and small.num_bytes <= one
    with pytest.raises(ValueError, match="must be lengths covering the block's"):
        store.block_kv(block.token_ids, block.segments[:-1], 4)
    with pytest.raises(ValueError, match="must be lengths covering the block's"):
        store.block_kv(block.token_ids, [-1, 1 + block.segments[0], *block.segments[1:]], 4)
    # An empty piece is skipped, not taken for the end of the block.
    gapped, gapped_shifts = store.block_kv(block.token_ids, [block.segments[0], 0, *block.segments[1:]], 9)
    torch.testing.assert_close(gapped_shifts, store.block_kv(block.token_ids, block.segments, 9)[1])
    assert gapped[0][0].shape[2] == 9


def test_bad_staged_kv_is_refused_before_anything_changes(model):
    """Each malformed staging raises an error that names the problem, and the row is left as it
    was: the next plain step still computes exactly what a fresh prefill does."""
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([[5, 6, 7, 8]])

    def kv(layers=2, n=3, heads=2, dtype=torch.float32):
        return [(torch.zeros(1, heads, n, 16, dtype=dtype), torch.zeros(1, heads, n, 16, dtype=dtype))] * layers

    feed = [9, 10, 11, 12, 13]
    cases = [
        ({0: (kv(), torch.zeros(3))}, feed[:4], "at least one after"),
        ({0: (kv(), torch.zeros(2))}, feed, "gives \\(2,\\) shifts"),
        ({0: (kv(layers=1), torch.zeros(3))}, feed, "KV for 1 layers; the model has 2"),
        ({0: (kv(heads=1), torch.zeros(3))}, feed, "layer 0: staged KV is \\(1, 1, 3, 16\\)"),
        ({0: (kv(dtype=torch.float16), torch.zeros(3))}, feed, "torch.float16, expected"),
        ({1: (kv(), torch.zeros(3))}, feed, "staged row 1 is not in the batch of 1"),
    ]
    for staged, rows, message in cases:
        with pytest.raises(ValueError, match=message):
            runner.step([rows], staged=staged)
        assert (runner.lengths, runner.num_columns) == ([4], 4)
    logits = runner.step([[9]])
    with torch.no_grad():
        want = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0, -1].float()
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
