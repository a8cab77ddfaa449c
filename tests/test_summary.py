"""``append_format: summary``: a hop's arrival drops the earlier evidence blocks from the cache.

With one decoder layer a token's key and value depend only on the token and its position, so a cache
that evicted spans (and re-rotated what follows) must equal a fresh prefill of the kept tokens:
the engine's bookkeeping (which spans, where in the cache, what the reference re-prefills) is then
checked exactly, against the reference mode that re-prefills the kept tokens after each hop."""

import pytest
import torch

from rig_decode.config import ConfigError, RigConfig
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ForceScript, ScriptedRetriever, one_layer_model, tiny_model
from .test_exactness import PROMPTS, _script


class KeptRecorder:
    """Each row's raw logits with the kept token list they follow."""

    def __init__(self):
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            self.seen.append((seq.kept_ids, scores[i].detach().clone()))
        return scores

    def worst_error(self, model) -> float:
        """Largest difference from a cache-free forward over the kept tokens."""
        worst = 0.0
        for kept, logits in self.seen:
            with torch.no_grad():
                ref = model(input_ids=torch.tensor([kept])).logits[0, -1].float()
            worst = max(worst, (logits - ref).abs().max().item())
        return worst


def _run(model, tok, *, append_format, reprefill=False, recorder=None):
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    opts = EngineOptions(max_iterations=3, max_new_tokens=70, evidence_token_budget=64, top_k=2,
                         append_format=append_format, reprefill=reprefill)
    extra = ([recorder] if recorder else []) + [ForceScript(_script(vocab, tok.eos_token_id))]
    engine = RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=extra)
    seqs = [engine.new_sequence(tok.encode(p), seq_id=i) for i, p in enumerate(PROMPTS)]
    return engine.generate(seqs)


@pytest.fixture(scope="module")
def one_layer(tok):
    return one_layer_model(len(tok), seed=1)


def test_summary_keeps_only_the_latest_evidence_block(one_layer, tok):
    rec = KeptRecorder()
    seqs = _run(one_layer, tok, append_format="summary", recorder=rec)
    assert [s.trace.num_hops for s in seqs] == [2, 1, 3]
    for s in seqs:
        steps = s.trace.retrieval_steps
        assert s.trace.evicted_tokens == sum(st.evidence_tokens for st in steps[:-1])
        assert [st.info.get("evicted_tokens", 0) for st in steps[1:]] == [st.evidence_tokens for st in steps[:-1]]
        assert s.evicted == [(st.position, st.position + st.evidence_tokens) for st in steps[:-1]]
        assert s.num_kept == len(s.token_ids) - s.trace.evicted_tokens
    # every step's logits equal a plain forward over the tokens the cache kept
    assert rec.worst_error(one_layer) <= 2e-4
    # ...and the reference engine, which re-prefills the kept tokens after each hop, agrees
    reference = _run(one_layer, tok, append_format="summary", reprefill=True)
    for a, b in zip(seqs, reference):
        assert a.token_ids == b.token_ids and a.evicted == b.evicted


@pytest.mark.parametrize("append_format", ["full", "summary"])
def test_a_repeated_query_reuses_evidence_only_while_it_is_in_context(one_layer, tok, append_format):
    """The same query twice: with every block kept, the second hop points to the first one's
    documents ("see [1] above"); in summary mode that block leaves the cache at the second hop,
    so the second hop searches again and the documents are in context once more."""
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    query = vocab.marker_token_ids("error E1234 fixed in release")
    opts = EngineOptions(max_iterations=3, max_new_tokens=70, evidence_token_budget=64, top_k=2,
                         append_format=append_format, reuse_similarity=0.8)
    retriever = ScriptedRetriever()
    engine = RigEngine(one_layer, tok, retriever, opts, extra_processors=[ForceScript({0: {2: query, 30: query}})])
    (s,) = engine.generate([engine.new_sequence(tok.encode(PROMPTS[0]), seq_id=0)])
    first, second = s.trace.retrieval_steps
    kept = tok.decode(s.kept_ids)
    assert first.docs
    if append_format == "full":
        assert second.info["reuse"]["numbers"] == [d.number for d in first.docs] and not second.docs
        assert len(retriever.batches) == 1 and "Already retrieved: see [1], [2] above" in kept
    else:
        assert "reuse" not in second.info and [d.id for d in second.docs] == [d.id for d in first.docs]
        assert len(retriever.batches) == 2 and "Already retrieved" not in kept and first.docs[0].text in kept


def test_full_format_evicts_nothing(model, tok):
    seqs = _run(model, tok, append_format="full")
    assert all(s.trace.evicted_tokens == 0 and s.kept_ids == s.token_ids for s in seqs)


def test_summary_on_a_deep_model_decodes_and_bounds_the_cache(model, tok):
    """Deeper layers keep what a dropped block contributed (an approximation, measured by rig eval),
    but after every step each row's cache holds exactly its kept tokens (those not yet fed aside)."""
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    opts = EngineOptions(max_iterations=3, max_new_tokens=70, evidence_token_budget=64, top_k=2,
                         append_format="summary")
    engine = RigEngine(model, tok, ScriptedRetriever(), opts,
                       extra_processors=[ForceScript(_script(vocab, tok.eos_token_id))])
    seqs = [engine.new_sequence(tok.encode(p), seq_id=i) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        engine.add(s)
    runner, evicting = engine.runner, 0
    while engine.has_unfinished:
        engine.step()
        for i, s in enumerate(engine.running):
            if not s.is_finished:
                kept = s.num_kept - len(s.pending)
                assert runner.lengths[i] == int(runner.attn[i].sum()) == kept <= runner.ends[i]
                evicting += bool(s.evicted)
    assert evicting > 0
    assert [s.trace.num_hops for s in seqs][:2] == [2, 1] and seqs[2].trace.num_hops >= 2
    for s in seqs:
        assert s.finish_reason in ("stop", "length")
        assert len(s.kept_ids) == s.num_kept < len(s.token_ids) or s.trace.num_hops == 1


def test_summary_needs_an_in_process_runner(tok):
    with pytest.raises(ConfigError, match="append_format: summary"):
        RigConfig.from_dict({"engine": {"backend": "remote", "remote": {"base_url": "http://127.0.0.1:1"}},
                             "rig": {"append_format": "summary"}})

    class NoEvict:
        context_limit = 100

        def reset(self, n=0):
            pass

    with pytest.raises(ValueError, match="cannot do"):
        RigEngine(None, tok, None, EngineOptions(append_format="summary"), runner=NoEvict())
    with pytest.raises(ValueError, match="full or summary"):
        RigEngine(None, tok, None, EngineOptions(append_format="short"), runner=NoEvict())


@pytest.mark.parametrize("options", [dict(append_format="summary"), dict(zero_prefill=True)])
def test_keys_that_cannot_be_re_rotated_are_refused_when_the_engine_is_built(tok, options):
    """Summary mode and zero-prefill move cached keys to other positions: a model whose rotary
    embedding cannot be re-rotated is refused up front, not by an error at its first hop."""
    model = tiny_model(len(tok))
    model.model.rotary_emb.rope_type = "dynamic"
    what = "zero_prefill" if "zero_prefill" in options else "append_format: summary"
    with pytest.raises(ValueError, match=f"{what} re-rotates cached keys: rope type 'dynamic'"):
        RigEngine(model, tok, None, EngineOptions(**options))
    RigEngine(model, tok, None, EngineOptions(reprefill=True, **options))  # the reference re-prefills instead
    model.config.head_dim = 32  # twice what its rotary embedding covers
    model.model.rotary_emb.rope_type = "default"
    with pytest.raises(ValueError, match="covers 16 of head_dim 32 \\(partial rotary\\)"):
        RigEngine(model, tok, None, EngineOptions(**options))


def test_zero_prefill_and_summary_come_from_the_config():
    from rig_decode.session import engine_options

    cfg = RigConfig.from_dict({"rig": {"append_format": "summary"},
                               "engine": {"zero_prefill": {"enabled": True, "recompute": 0.25, "store_mb": 8,
                                                           "host_store_mb": 64}}})
    opts = engine_options(cfg, None)
    assert (opts.append_format, opts.zero_prefill, opts.zero_prefill_recompute, opts.chunk_store_bytes,
            opts.chunk_store_host_bytes) == ("summary", True, 0.25, 8 << 20, 64 << 20)
    with pytest.raises(ConfigError, match="engine.zero_prefill.recompute"):
        RigConfig.from_dict({"engine": {"zero_prefill": {"recompute": 2}}})
    with pytest.raises(ConfigError, match="engine.zero_prefill.host_store_mb"):
        RigConfig.from_dict({"engine": {"zero_prefill": {"host_store_mb": -1}}})
