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
from rig_decode.kernels import rope_of, rope_shift_
from rig_decode.kernels.chunk_kv import ChunkKVStore
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.retrieval.base import Hit

from .helpers import (ForceScript, ScriptedRetriever, load_script, neighbour_paired_model, one_layer_model,
                      smollm3_one_layer, tiny_model)
from .test_exactness import PROMPTS, _script
from .test_summary import KeptRecorder


def _run(model, tok, *, zero_prefill, recorder=None, recompute=0.1, engine=None, select="tail", **options):
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    opts = EngineOptions(max_iterations=3, max_new_tokens=70, evidence_token_budget=64, top_k=2,
                         zero_prefill=zero_prefill, zero_prefill_recompute=recompute, zero_prefill_select=select,
                         **options)
    extra = ([recorder] if recorder else []) + [ForceScript(_script(vocab, tok.eos_token_id))]
    engine = engine or RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=extra)
    seqs = [engine.new_sequence(tok.encode(p), seq_id=i) for i, p in enumerate(PROMPTS)]
    return engine.generate(seqs), engine


@pytest.fixture(scope="module")
def one_layer(tok):
    return one_layer_model(len(tok), seed=2)


@pytest.mark.parametrize("select", ["tail", "deviation"])
def test_zero_prefill_is_exact_on_one_layer(one_layer, tok, select):
    rec = KeptRecorder()
    zero, engine = _run(one_layer, tok, zero_prefill=True, recorder=rec, select=select, recompute=0.25)
    exact, _ = _run(one_layer, tok, zero_prefill=False)
    assert [s.trace.num_hops for s in zero] == [2, 1, 3]
    for s in zero:
        for st in s.trace.retrieval_steps:
            zp = st.info["zero_prefill"]
            assert zp["reused_tokens"] + zp["recomputed_tokens"] == st.evidence_tokens
            assert zp["reused_tokens"] > 0 and zp["recomputed_tokens"] >= 1 and zp["select"] == select
    assert rec.worst_error(one_layer) <= 2e-4
    assert [s.token_ids for s in zero] == [s.token_ids for s in exact]
    assert engine.chunks.hits > 0  # the evidence head and tail recur on every hop


@pytest.mark.parametrize("kind", ["nope", "interleaved"])
def test_zero_prefill_is_exact_on_one_layer_of_another_rope(tok, kind):
    """A NoPE layer (SmolLM3's) caches keys without position, and Cohere rotates the key pairs
    (2i, 2i + 1): pieces copied in unrotated, or rotated in that layout, leave exactly the exact
    splice's cache."""
    model = smollm3_one_layer(len(tok), rope=False, seed=2) if kind == "nope" else neighbour_paired_model("cohere", len(tok), 2)
    rec = KeptRecorder()
    zero, engine = _run(model, tok, zero_prefill=True, recorder=rec)
    exact, _ = _run(model, tok, zero_prefill=False)
    assert engine.chunks.hits > 0 and rec.worst_error(model) <= 2e-4
    assert [s.token_ids for s in zero] == [s.token_ids for s in exact]


@pytest.mark.parametrize("select", ["tail", "deviation"])
def test_zero_prefill_on_a_deep_model_runs_and_reuses_pieces(deep, tok, select):
    seqs, engine = _run(deep, tok, zero_prefill=True, select=select, recompute=0.3)
    assert [s.trace.num_hops for s in seqs][:2] == [2, 1]
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    one = tuple(tok.encode("[1]", add_special_tokens=False))
    assert any(lead == one for lead, _ in engine.chunks._device_tier.items)  # the texts, stored under their lead
    misses = engine.chunks.misses
    _run(deep, tok, zero_prefill=True, engine=engine)  # same questions again: same pieces
    assert engine.chunks.misses - misses <= 3 and engine.chunks.hits > misses


def test_pieces_served_from_the_host_tier_decode_the_same(deep, tok):
    """With no room on the device, the engine's pieces live in the host tier: the same tokens as
    a device store, and the repeated questions' pieces come from the host."""
    on_device, _ = _run(deep, tok, zero_prefill=True)
    on_host, engine = _run(deep, tok, zero_prefill=True, chunk_store_bytes=0, chunk_store_host_bytes=64 << 20)
    assert [s.token_ids for s in on_host] == [s.token_ids for s in on_device]
    assert engine.chunks.num_bytes == 0 and engine.chunks.host_num_bytes > 0
    hits = engine.chunks.host_hits
    _run(deep, tok, zero_prefill=True, engine=engine)
    assert engine.chunks.host_hits > hits


def test_rows_splicing_in_one_step_compute_their_pieces_in_one_forward(deep, tok):
    """Two rows whose hops land in the same step: their blocks are assembled together, the pieces
    both lack computed in one forward; each row decodes what it decodes alone."""
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    queries = [vocab.marker_token_ids("error E1234 fixed in release"), vocab.marker_token_ids("data loss")]
    end = 2 + max(len(q) for q in queries)
    script = {i: {end - len(q): q} for i, q in enumerate(queries)}  # both markers end at the same step

    def run(prompts):
        opts = EngineOptions(max_iterations=1, max_new_tokens=30, evidence_token_budget=64, top_k=2,
                             zero_prefill=True, sync_retrieval=True)  # both searches end in the step they start
        engine = RigEngine(deep, tok, ScriptedRetriever(), opts, extra_processors=[ForceScript(script)])
        computed = []
        compute = engine.chunks._compute
        engine.chunks._compute = lambda pieces: computed.append([len(ids) for _, ids in pieces]) or compute(pieces)
        seqs = engine.generate([engine.new_sequence(tok.encode(p), seq_id=i) for i, p in prompts])
        return seqs, computed

    together, computed = run([(0, PROMPTS[0]), (1, PROMPTS[1])])
    infos = [s.trace.retrieval_steps[0].info["zero_prefill"] for s in together]
    assert [i["blocks_assembled_together"] for i in infos] == [2, 2]
    alone = [run([(s.seq_id, PROMPTS[s.seq_id])]) for s in together]
    for s, (seqs, _) in zip(together, alone):
        assert seqs[0].token_ids == s.token_ids
    each = [sum(map(len, calls)) for _, calls in alone]  # pieces computed, alone
    tokens = [sum(map(sum, calls)) for _, calls in alone]
    assert [i["piece_misses"] for i in infos] == each and [i["piece_hits"] for i in infos] == [0, 0]
    assert [i["piece_tokens_computed"] for i in infos] == tokens
    # One forward for what both blocks lack: more pieces than either block alone, the shared ones once.
    assert len(computed) == 1 and max(each) < len(computed[0]) < sum(each)


def test_assembling_pieces_is_charged_once_to_the_splicing_rows_only(deep, tok, monkeypatch):
    """The shared assembly's time goes once into each splicing row's hop, and not into the decode
    time of a row that only decodes in that step. The engine's clock is a fake that stands still
    except while pieces are assembled, which takes ten seconds of it."""
    from types import SimpleNamespace

    from rig_decode.engine import engine, hops, postprocess

    clock = [0.0]
    for module in (engine, hops, postprocess):  # the step's clock, wherever the engine reads it
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    opts = EngineOptions(max_iterations=1, max_new_tokens=40, evidence_token_budget=64, top_k=2,
                         zero_prefill=True, sync_retrieval=True)
    engine = RigEngine(deep, tok, ScriptedRetriever(), opts,
                       extra_processors=[ForceScript({0: {2: vocab.marker_token_ids("data loss")}})])
    blocks_kv = engine.chunks.blocks_kv

    def slow(blocks):
        clock[0] += 10.0
        return blocks_kv(blocks)

    engine.chunks.blocks_kv = slow
    spliced, decoding = engine.generate([engine.new_sequence(tok.encode(p), seq_id=i)
                                         for i, p in enumerate(PROMPTS[:2])])
    (hop,) = spliced.trace.retrieval_steps
    assert hop.info["zero_prefill"]["kv_ms"] == hop.splice_ms == spliced.trace.splice_ms == 10_000  # once
    assert not decoding.trace.retrieval_steps and decoding.trace.decode_ms == 0


@pytest.mark.parametrize("select", ["tail", "deviation"])
def test_full_recompute_stages_nothing(model, tok, select):
    seqs, _ = _run(model, tok, zero_prefill=True, recompute=1.0, select=select)
    exact, _ = _run(model, tok, zero_prefill=False)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in exact]
    assert all("zero_prefill" not in st.info for s in seqs for st in s.trace.retrieval_steps)


def test_block_kv_matches_pieces_and_store_is_bounded(model, tok):
    fmt = EvidenceFormatter(tok, 64)
    hits = [Hit("a", "Release 4.2.1 fixed error E1234.", 1.0), Hit("b", "Priya Raman approved it.", 0.9)]
    block = fmt.render_block(hits, 1)
    assert sum(block.segments) == len(block.token_ids) and len(block.segments) == 6  # head, 2 x (number, text), tail
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


def test_a_documents_text_is_computed_once_under_any_number(deep, tok):
    """A document's text is one piece, computed after ``[1]``: under number 1 its KV is that of
    the whole line computed alone; under another number the store hands out the same KV, and a
    block of documents already seen, in another order, computes no piece at all."""
    fmt = EvidenceFormatter(tok, 200)
    hits = [Hit("a", "Release 4.2.1 fixed error E1234.", 1.0), Hit("b", "Priya Raman approved it.", 0.9)]
    first, swapped = fmt.render_block(hits, 1), fmt.render_block(hits[::-1], 1)
    store = ChunkKVStore(deep)
    head, number, text = first.segments[:3]
    assert first.leads[:3] == [[], [], tok.encode("[1]", add_special_tokens=False)]
    line = store.get(first.token_ids[head : head + number + text])  # "[1] Release ..." alone
    led = store.get(first.token_ids[head + number : head + number + text], first.leads[2])
    for (k, v), (k1, v1) in zip(led, line):
        torch.testing.assert_close(k, k1[:, :, number:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v1[:, :, number:], atol=1e-5, rtol=1e-5)
    kv, shifts = store.block_kv(first.token_ids, first.segments, len(first.token_ids), first.leads)
    assert shifts[head + number] == head + number - len(first.leads[2])  # from its place after its lead
    assert ([*first.leads[2]], first.token_ids[head + number : head + number + text]) in store  # a list lead too
    with pytest.raises(TypeError, match="a piece is token ids or \\(lead, token ids\\)"):
        store.get(store.pieces(first.token_ids, first.segments, 9, first.leads)[0])  # a piece where ids go
    misses = store.misses
    again, _ = store.block_kv(swapped.token_ids, swapped.segments, len(swapped.token_ids), swapped.leads)
    assert store.misses == misses and swapped.token_ids != first.token_ids
    b_first = head + sum(first.segments[1:4])  # document b's text, second in the first block
    torch.testing.assert_close(again[1][1][:, :, head + number : head + number + swapped.segments[2]],
                               kv[1][1][:, :, b_first : b_first + swapped.segments[2]])


def test_a_cut_document_is_served_from_its_whole_text(deep, tok):
    """A document the budget cut is a prefix of its whole text's piece, after the same lead: once
    the whole text is held the cut one is its first columns, computed by no forward; held first,
    the cut one goes when the whole text comes, so a document is held once."""
    fmt = EvidenceFormatter(tok, 200)
    hits = [Hit("a", "Release 4.2.1 fixed error E1234 in the sync daemon.", 1.0),
            Hit("b", "Priya Raman approved the release after a week of testing it.", 0.9)]
    whole = fmt.render_block(hits, 1)
    cut = fmt.render_block(hits, 1, budget=len(whole.token_ids) - 6)
    assert cut.truncated and cut.doc_ids == ["a", "b"]
    head, number, text = whole.segments[:3]
    at = head + sum(whole.segments[1:4])  # document b's text
    full_b = (tuple(whole.leads[4]), tuple(whole.token_ids[at : at + whole.segments[4]]))
    cut_b = (tuple(cut.leads[4]), tuple(cut.token_ids[at : at + cut.segments[4]]))
    assert 0 < len(cut_b[1]) < len(full_b[1]) and full_b[1][: len(cut_b[1])] == cut_b[1]
    fresh = ChunkKVStore(deep).get(cut_b[1], cut_b[0])

    store = ChunkKVStore(deep)
    store.block_kv(whole.token_ids, whole.segments, len(whole.token_ids), whole.leads)
    assert cut_b in store and store.prefix_hits == 0
    misses, held = store.misses, len(store)
    kv, _ = store.block_kv(cut.token_ids, cut.segments, len(cut.token_ids), cut.leads)
    assert store.prefix_hits == 1 and store.misses == misses + 1 and len(store) == held + 1  # only the ellipsis
    got = kv[3][1][:, :, at : at + len(cut_b[1])]
    torch.testing.assert_close(got, store.get(full_b[1], full_b[0])[3][1][:, :, : len(cut_b[1])], atol=0, rtol=0)
    torch.testing.assert_close(got, fresh[3][1], atol=1e-5, rtol=1e-5)

    # The cut text first: computed and held, until the whole text replaces it.
    store = ChunkKVStore(deep)
    store.get(cut_b[1], cut_b[0])
    one = store.num_bytes
    store.get(full_b[1], full_b[0])
    assert len(store) == 1 and store.num_bytes > one and cut_b in store
    store.get(cut_b[1], cut_b[0])
    assert (store.misses, store.prefix_hits) == (2, 1)

    # Both missing in one call: only the whole text goes through the model.
    forwards = []
    hook = deep.model.register_forward_pre_hook(lambda _, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]),
                                                with_kwargs=True)
    try:
        store = ChunkKVStore(deep)
        both = store.get_many([cut_b, full_b])
    finally:
        hook.remove()
    assert forwards == [len(full_b[0]) + len(full_b[1])] and len(store) == 1 and store.misses == 2
    torch.testing.assert_close(both[0][2][0], both[1][2][0][:, :, : len(cut_b[1])], atol=0, rtol=0)

    # From the host tier too; and not under another lead, nor for a piece shorter than the index.
    size = store.num_bytes
    store = ChunkKVStore(deep, max_bytes=size, host_bytes=size)
    store.get(full_b[1], full_b[0])
    store.get(list(range(3, 3 + len(full_b[1]))))  # pushes the whole text to the host
    store.get(cut_b[1], cut_b[0])
    assert (store.host_hits, store.prefix_hits, store.misses) == (1, 1, 2)
    assert ((), cut_b[1]) not in store and (full_b[0], full_b[1][:3]) not in store


def test_a_whole_text_replaces_its_cut_one_first(deep):
    """The cut piece a whole one supersedes goes before the whole one is stored, so it pushes out
    nothing that both fit beside; a whole piece that fits the host tier only leaves a cut one on
    the device, which keeps serving it from there; an empty piece is refused."""
    one = _piece_bytes(deep, 1)
    other, whole = list(range(30, 36)), list(range(10, 18))
    store = ChunkKVStore(deep, max_bytes=14 * one)  # room for the other piece and the whole one
    store.get(other)
    store.get(whole[:5])
    store.get(whole)
    assert len(store) == 2 and other in store and store.num_bytes == 14 * one
    store.get(other)
    assert store.misses == 3

    store = ChunkKVStore(deep, max_bytes=6 * one, host_bytes=8 * one)
    store.get(whole[:5])
    store.get(whole)  # too big for the device tier: to the host, beside the cut one
    assert (store.num_bytes, store.host_num_bytes, len(store)) == (5 * one, 8 * one, 2)
    store.get(whole[:5])
    store.get(whole[:4])  # from the cut one, on the device
    assert (store.hits, store.host_hits, store.prefix_hits) == (2, 0, 1)
    with pytest.raises(ValueError, match="a piece has at least one token"):
        store.get_many([[], whole])


def _piece_bytes(model, n: int) -> int:
    return sum(k.nbytes + v.nbytes for k, v in ChunkKVStore(model).get(list(range(3, 3 + n))))


def test_pieces_computed_after_a_prefix_are_exact_right_after_it(deep):
    """With ``prefix``, a piece is computed after it: a row holding exactly that prefix gets the
    piece's in-context KV, so zero-prefill equals the exact splice on a deep model (the keys sit at
    positions ``len(prefix)..``; the shifts move them from there)."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 200, (17,), generator=gen).tolist()
    block = torch.randint(3, 200, (11,), generator=gen).tolist()
    store = ChunkKVStore(deep, prefix=prefix)
    kv, shifts = store.block_kv(block, [len(block)], len(block) - 1)
    assert kv[0][0].shape[2] == len(block) - 1 and set(shifts.tolist()) == {-float(len(prefix))}
    exact = HFModelRunner(deep, pad_id=0)
    exact.prefill([prefix])
    want = exact.step([block])[0]
    torch.testing.assert_close(kv[3][1], exact.cache.layers[3].values[:, :, len(prefix) : -1], atol=1e-5, rtol=1e-5)
    runner = HFModelRunner(deep, pad_id=0)
    runner.prefill([prefix[:-1]])
    got = runner.step([[prefix[-1], *block]], staged={0: (kv, shifts)})[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Computed alone, the same piece is not in-context KV on this model.
    alone, _ = ChunkKVStore(deep).block_kv(block, [len(block)], len(block) - 1)
    assert not torch.allclose(alone[3][1], kv[3][1], atol=1e-3)
    store.get(block[4:])
    assert (store.misses, len(store)) == (2, 2)  # the prefix's KV is computed once, not stored as a piece


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("prefix", [None, [5, 6, 7, 8]])
def test_missing_pieces_are_computed_together_in_one_forward(tok, attention, prefix):
    """The pieces a block lacks go through the model in one forward, packed without padding,
    each attending to the prefix, its lead and itself only: the same KV as each piece computed on
    its own after the prefix and its lead."""
    model = tiny_model(len(tok), seed=7, layers=3)
    model.set_attn_implementation(attention)
    gen = torch.Generator().manual_seed(8)
    ids = [tuple(torch.randint(3, 200, (n,), generator=gen).tolist()) for n in (3, 9, 1, 6)]
    lead = tuple(torch.randint(3, 200, (2,), generator=gen).tolist())
    pieces = [((), ids[0]), (lead, ids[1]), ((), ids[2]), (lead, ids[3]), ((), ids[0])]  # one twice: computed once
    pieces.append((lead, ids[0]))  # the same ids after a lead: another piece
    forwards = []
    hook = model.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        store = ChunkKVStore(model, prefix=prefix)
        store.get(ids[1], lead)  # already held: not computed again
        before = len(forwards)
        got = store.get_many(pieces)
    finally:
        hook.remove()
    assert len(forwards) - before == 1 and (store.misses, store.hits) == (5, 2) and len(store) == 5
    assert (lead, ids[3]) in store and ((), ids[3]) not in store
    for (lead, ids), kv in zip(pieces, got):
        alone = ChunkKVStore(model, prefix=[*(prefix or []), *lead]).get(ids)  # the lead as a prefix
        assert kv[0][0].shape[2] == len(ids)
        for (k, v), (k1, v1) in zip(kv, alone):
            torch.testing.assert_close(k, k1, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, v1, atol=1e-5, rtol=1e-5)


DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_host_tier_keeps_what_the_device_tier_pushes_out(tok, device):
    """A piece the device tier pushes out goes to the host tier; a hit there copies it back (and
    moves it back to the device tier) instead of computing it; what the host tier pushes out is
    dropped. The KV is the same whichever tier served it."""
    model = tiny_model(len(tok), seed=7, layers=3).to(device)
    gen = torch.Generator().manual_seed(9)
    p1, p2, p3, p4 = (torch.randint(3, 200, (5,), generator=gen).tolist() for _ in range(4))
    want = ChunkKVStore(model).get_many([p1, p2])
    one = sum(k.nbytes + v.nbytes for k, v in want[0])
    store = ChunkKVStore(model, max_bytes=one, host_bytes=2 * one)
    store.get(p1)
    store.get(p2)  # p1 to the host
    assert (store.num_bytes, store.host_num_bytes, len(store)) == (one, one, 2)
    host_k = store._host_tier.items[(), tuple(p1)][0][0]
    assert host_k.device.type == "cpu" and (device == "cpu" or host_k.is_pinned())
    store.get(p3)  # p2 to the host, beside p1
    got = store.get(p1)  # from the host: back on the device, p3 to the host
    assert (store.misses, store.hits, store.host_hits) == (3, 1, 1)
    assert (store.num_bytes, store.host_num_bytes, len(store)) == (one, 2 * one, 3)
    for (k, v), (k1, v1) in zip(got, want[0]):
        assert k.device == k1.device
        torch.testing.assert_close(k, k1)
        torch.testing.assert_close(v, v1)
    store.get(p4)  # p1 to the host, which drops p2, its least recently used
    store.get(p2)
    assert (store.misses, store.host_hits) == (5, 1)
    # No device tier: every piece is kept on the host and copied over on each hit.
    host_only = ChunkKVStore(model, max_bytes=0, host_bytes=one)
    host_only.get(p1)
    again = host_only.get(p1)
    assert (host_only.host_hits, host_only.num_bytes, host_only.host_num_bytes) == (1, 0, one)
    torch.testing.assert_close(again[1][1], want[0][1][1])
    with pytest.raises(ValueError, match="host_bytes must be >= 0"):
        ChunkKVStore(model, host_bytes=-1)


def test_bad_staged_kv_is_refused_before_anything_changes(model, monkeypatch):
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
    with monkeypatch.context() as m:  # keys that cannot be re-rotated: refused before the marker is fed
        m.setattr(model.model.rotary_emb, "rope_type", "dynamic")
        with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
            runner.step([feed], staged={0: (kv(), torch.zeros(3))})
        assert (runner.lengths, runner.num_columns) == ([4], 4)
    logits = runner.step([[9]])
    with torch.no_grad():
        want = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0, -1].float()
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)


# -- CacheBlend's selection: the runner recomputes the most deviating staged tokens in place ------------


@pytest.fixture(scope="module")
def deep(tok):
    return tiny_model(len(tok), seed=7, layers=4)  # deeper than the probe: its forward is stopped


def _stage_case(model, gen):
    context = torch.randint(3, 200, (23,), generator=gen).tolist()
    block = torch.randint(3, 200, (19,), generator=gen).tolist()
    return context, block, [4, 6, 5, 4]


@pytest.mark.parametrize("share", [0.1, 0.3, 1.0])
def test_reselected_tokens_match_the_measured_variant(deep, share):
    """The runner's selection gives the logits of ``bench/zero_prefill_select.py``'s
    ``deviation@1`` variant (the harness the figures in docs come from); with every staged token
    reselected, those of the exact splice."""
    bench = load_script("bench/zero_prefill_select.py")
    context, block, segments = _stage_case(deep, torch.Generator().manual_seed(1))
    c, m = len(context), len(block)
    store = ChunkKVStore(deep)
    # The harness: context KV, the block's pieces rotated into place, deviations from the exact forward.
    exact = HFModelRunner(deep, pad_id=0)
    exact.prefill([context])
    ctx_kv = [(layer.keys[:, :, :c].clone(), layer.values[:, :, :c].clone()) for layer in exact.cache.layers]
    want_exact = exact.step([block])[0]
    kv, shift = store.block_kv(block, segments, m)
    inv = rope_of(deep).inv_freq
    stored = []
    for k, v in kv:
        k = k.clone()
        rope_shift_(k, torch.zeros(m, dtype=torch.long), torch.arange(m), shift + c, inv)
        stored.append((k, v))
    in_context = exact.cache.layers[1].values[:, :, c : c + m]
    dev = ((stored[1][1] - in_context) ** 2).sum(dim=(0, 1, 3)) / (in_context**2).sum(dim=(0, 1, 3))
    selected = bench.select("deviation@1", share, m, {"deviation@1": dev})
    want, _ = bench.run_variant(deep, ctx_kv, stored, block, selected, [0])
    # The runner: the marker's last token, then the block, all of it staged but its last token.
    runner = HFModelRunner(deep, pad_id=0)
    runner.prefill([context[:-1]])
    staged = {0: store.block_kv(block, segments, m - 1)}
    got = runner.step([[context[-1], *block]], staged=staged, reselect={0: len(selected) - 1})[0]
    torch.testing.assert_close(got, want[0], atol=1e-4, rtol=1e-4)
    if share == 1.0:
        torch.testing.assert_close(got, want_exact, atol=1e-4, rtol=1e-4)
    assert runner.lengths == [c + m] and runner.ends == [c + m]
    # The row goes on decoding from there like the harness's.
    nxt = int(got.argmax())
    assert int(runner.step([[nxt]])[0].argmax()) == bench.run_variant(deep, ctx_kv, stored, block, selected,
                                                                       [nxt, 0])[1][1]


def test_bad_reselect_is_refused_before_anything_changes(deep):
    runner = HFModelRunner(deep, pad_id=0)
    runner.prefill([[5, 6, 7, 8]])
    kv = ChunkKVStore(deep).block_kv([9, 10, 11], [3], 3)
    for staged, reselect, message in (({0: kv}, {0: 4}, "reselects 4 tokens; it stages 3"),
                                      ({0: kv}, {0: 1.5}, "reselects 1.5 tokens"),
                                      ({0: kv}, {1: 1}, "row 1 reselects 1 tokens; it stages 0"),
                                      (None, {0: 1}, "nothing is staged")):
        with pytest.raises(ValueError, match=message):
            runner.step([[9, 9, 10, 11, 12]], staged=staged, reselect=reselect)
        assert (runner.lengths, runner.num_columns) == ([4], 4)


@pytest.mark.parametrize("reselect_b", [0, 2])
def test_reselect_in_a_batch_leaves_the_other_rows_exact(deep, reselect_b):
    """A reselecting row beside a decoding row and a row staging with or without reselecting:
    each row gets what it gets alone."""
    gen = torch.Generator().manual_seed(3)
    store = ChunkKVStore(deep)
    (ctx_a, block_a, seg), (ctx_b, block_b, _) = _stage_case(deep, gen), _stage_case(deep, gen)
    ctx_c = torch.randint(3, 200, (30,), generator=gen).tolist()

    def alone(context, feed, staged=None, reselect=None):
        runner = HFModelRunner(deep, pad_id=0)
        runner.prefill([context])
        return runner.step([feed], staged=staged, reselect=reselect)[0]

    staged_a = store.block_kv(block_a, seg, len(block_a) - 1)
    staged_b = store.block_kv(block_b, seg, len(block_b) - 1)
    runner = HFModelRunner(deep, pad_id=0)
    runner.prefill([ctx_a[:-1], ctx_b[:-1], ctx_c])
    got = runner.step([[ctx_a[-1], *block_a], [ctx_b[-1], *block_b], [7]], staged={0: staged_a, 1: staged_b},
                      reselect={0: 4, 1: reselect_b})
    torch.testing.assert_close(got[0], alone(ctx_a[:-1], [ctx_a[-1], *block_a], {0: staged_a}, {0: 4}),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], alone(ctx_b[:-1], [ctx_b[-1], *block_b], {0: staged_b}, {0: reselect_b}),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], alone(ctx_c, [7]), atol=1e-4, rtol=1e-4)


def test_a_prompt_joining_beside_a_staged_row_becomes_the_cached_prefix(deep):
    """The staged step runs in several forwards; a lone joining row's prompt is captured as the
    cached prefix once it is whole in the cache, after the last of them."""
    gen = torch.Generator().manual_seed(4)
    context, block, seg = _stage_case(deep, gen)
    prompt = torch.randint(3, 200, (20,), generator=gen).tolist()
    runner = HFModelRunner(deep, pad_id=0)
    runner.prefill([context[:-1]])
    runner.add_rows([prompt])
    staged = {0: ChunkKVStore(deep).block_kv(block, seg, len(block) - 1)}
    got = runner.step([[context[-1], *block], prompt], staged=staged, reselect={0: 3})
    assert runner._prefix[0] == prompt
    with torch.no_grad():
        want = deep(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(got[1], want, atol=1e-4, rtol=1e-4)


def test_a_peft_wrapped_model_reselects_through_its_wrapper():
    """An nf4 model keeps its adapter unmerged (a PeftModel): CacheBlend's probe finds the decoder's
    layers through the wrapper, and with every staged token reselected the splice is exact."""
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(tiny_model(600, layers=4), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                   init_lora_weights=False)).eval()
    context, block, segments = _stage_case(wrapped, torch.Generator().manual_seed(2))
    exact = HFModelRunner(wrapped, pad_id=0)
    exact.prefill([context])
    want = exact.step([block])[0]
    runner = HFModelRunner(wrapped, pad_id=0)
    runner.prefill([context[:-1]])
    staged = {0: ChunkKVStore(wrapped).block_kv(block, segments, len(block) - 1)}
    got = runner.step([[context[-1], *block]], staged=staged, reselect={0: len(block) - 1})[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_failed_assembly_falls_back_to_the_exact_splice(deep, tok, monkeypatch):
    """Assembling staged KV that raises (a device out of memory, say) costs no row its hop: the
    blocks are fed whole, which is the exact splice, and the fallback is in each hop's trace."""
    exact, _ = _run(deep, tok, zero_prefill=False)

    def fails(self, blocks):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(ChunkKVStore, "blocks_kv", fails)
    fallback, engine = _run(deep, tok, zero_prefill=True)
    assert [s.token_ids for s in fallback] == [s.token_ids for s in exact]
    steps = [st for s in fallback for st in s.trace.retrieval_steps]
    assert steps and all("out of memory" in st.info["zero_prefill"]["fallback"] for st in steps)
