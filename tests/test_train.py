"""Marker training: traces equal what the decoder splices; the loss sees only what the model writes."""

import json
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")

from rig_decode.engine import EngineOptions, RigEngine  # noqa: E402
from rig_decode.eval import worlds  # noqa: E402
from rig_decode.eval.synth import generate  # noqa: E402
from rig_decode.retrieval.base import Document, Hit  # noqa: E402
from rig_decode.retrieval.dense import Embedder  # noqa: E402
from rig_decode.retrieval.index_retriever import IndexRetriever  # noqa: E402
from rig_decode.retrieval.ingest import Chunking, build_index  # noqa: E402
from rig_decode.retrieval.store import IndexStore  # noqa: E402
from rig_decode.train.data import TraceBuilder, variant_tokenizer  # noqa: E402
from rig_decode.train.lora import (  # noqa: E402
    IGNORE, TrainConfig, stop_backprop_below, add_marker_tokens, answer_start, collate, forward_loss, loss_weight,
    masked_loss, micro_batches, train, wrap_lora,
)

from .helpers import ROOT, load_script, tiny_model, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    corpus, splits = generate(seed=3, scale=0.34)
    docs = [Document(d["id"], d["text"], d["title"], d["metadata"]) for d in corpus]
    path = tmp_path_factory.mktemp("synth") / "index"
    build_index(docs, Embedder("all-minilm-l6-v2"), path, Chunking(words=10**6, chars=10**6), progress=False)
    retriever = IndexRetriever(IndexStore.load(path), None, "lexical")
    return splits, retriever


def test_splits_share_no_entities(world):
    splits, _ = world
    names = {s: {e for q in qs for e in q.entities if not e.isdigit()} for s, qs in splits.items()}  # not years
    assert names["train"] and names["test"]
    assert not names["train"] & names["test"] and not names["train"] & names["dev"]


def test_traces_have_the_engines_mask_and_every_kind(world):
    splits, retriever = world
    tok = tiny_tokenizer()
    builder = TraceBuilder(tok, retriever, "text", p_misleading=0.5, p_empty=0.3, seed=1)
    traces = [t for q in splits["train"] if (t := builder.build(_rec(q)))]
    assert len(traces) > 20 and builder.stats.built == len(traces)
    assert {"no_retrieval", "plain", "misleading_requery", "empty_requery"} <= set(builder.stats.kinds)
    for t in traces:
        assert len(t.input_ids) == len(t.mask) and t.mask[: t.prompt_len] == [0] * t.prompt_len
        assert t.mask[-1] == 1 and t.input_ids[-1] == tok.eos_token_id
        assert len(t.queries) == len(t.evidence_docs) >= (t.hops if t.kind != "no_retrieval" else 0)


def test_one_search_puts_both_values_of_a_comparison_in_one_block(tmp_path):
    """``one_search``: a comparison or two-chain yes/no question of one hop per chain asks for both
    entities in one query, and its one block shows both documents; other questions are unchanged."""
    corpus, splits = worlds.generate(seed=5, scale=0.5)
    docs = [Document(d["id"], d["text"], d["title"], d["metadata"]) for d in corpus]
    build_index(docs, Embedder("all-minilm-l6-v2"), tmp_path / "index", Chunking(words=10**6, chars=10**6),
                progress=False)
    retriever = IndexRetriever(IndexStore.load(tmp_path / "index"), None, "lexical")
    records = [dict(r, id=f"train-{k}") for k, r in enumerate(splits["train"])]
    built = {}
    for one_search in (False, True):
        builder = TraceBuilder(tiny_tokenizer(), retriever, "text", evidence_budget=1024, p_misleading=0.0, p_empty=0.0,
                               one_search=one_search)
        built[one_search] = {r["id"]: t for r in records if (t := builder.build(r))}
    assert "one_search" not in {t.kind for t in built[False].values()}
    paired = [t for t in built[True].values() if t.kind == "one_search"]
    assert len(paired) >= 5
    by_id = {r["id"]: r for r in records}
    for t in paired:
        rec = by_id[t.id]
        assert rec["kind"] in ("compare", "yesno") and len(rec["plan"]) == 2
        a, b = (p["entity"] for p in rec["plan"])
        assert len(t.queries) == 1 and a in t.queries[0] and b in t.queries[0]
        assert {p["doc"] for p in rec["plan"]} <= set(t.evidence_docs[0])
        assert len(built[False][t.id].queries) >= 2  # without the option: a search per chain
    for tid, t in built[True].items():  # every other question is built as before
        if t.kind != "one_search":
            assert by_id[tid]["kind"] == "chain" or len(by_id[tid]["plan"]) != 2 or t.queries, tid


class Replay:
    """Makes the engine write a trace's model tokens (by a large bias, not by forcing, so the
    engine records them as sampled: mask 1)."""

    def __init__(self, traces):
        self.traces = traces

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            t = self.traces[seq.seq_id]
            n = len(seq.token_ids)
            assert seq.token_ids == t.input_ids[:n], "the engine diverged from the trace"
            scores[i, t.input_ids[n]] += 1e4
        return scores


@pytest.mark.parametrize("variant", ["special", "json"])
def test_evidence_in_traces_is_what_the_decoder_splices(world, variant):
    splits, retriever = world
    builder = TraceBuilder(tiny_tokenizer(), retriever, variant, p_misleading=0.5, p_empty=0.0, seed=2)
    traces = [t for q in splits["train"][:40] if (t := builder.build(_rec(q)))][:10]
    assert any(len(t.queries) >= 2 for t in traces)
    tok = builder.tok
    model = tiny_model(len(tok))
    opts = EngineOptions(max_iterations=6, max_query_tokens=64, evidence_token_budget=256, top_k=3,
                         max_new_tokens=400, marker_style="special_token" if variant == "special" else "json",
                         newline_ends_query=False)
    engine = RigEngine(model, tok, retriever, opts, extra_processors=[Replay(traces)])
    seqs = [engine.new_sequence(t.input_ids[: t.prompt_len], seq_id=i) for i, t in enumerate(traces)]
    engine.generate(seqs)
    for s, t in zip(seqs, traces):
        assert s.token_ids == t.input_ids, t.id
        assert s.mask == t.mask, t.id
        assert [step.query for step in s.trace.retrieval_steps] == t.queries


def test_copied_names_keep_the_tokens_they_have_in_evidence(world, real):
    """Queries and answers start with a space, so the answer a trace teaches is the very token run
    its evidence holds; at the start of a text the model's tokenizer splits names differently."""
    splits, retriever = world
    builder = TraceBuilder(real[1], retriever, "special", p_misleading=0.0, p_empty=0.0, seed=4)
    traces = [t for q in splits["train"] if (t := builder.build(_rec(q))) and t.hops >= 2][:20]
    tok = builder.tok
    assert len(traces) == 20
    respelled = 0
    for t in traces:
        answer = tok.encode(" " + t.answer, add_special_tokens=False)
        assert t.input_ids[-1 - len(answer):-1] == answer, t.id
        evidence = [i for i, m in zip(t.input_ids, t.mask) if m == 0][t.prompt_len:]
        assert _contains(evidence, answer), t.id
        respelled += not _contains(evidence, tok.encode(t.answer, add_special_tokens=False))
        start = builder.marker_ids[0]
        for k in range(t.prompt_len, len(t.input_ids) - 1):
            if t.input_ids[k] == start:  # a query begins with a word-initial token
                assert tok.convert_ids_to_tokens(t.input_ids[k + 1]).startswith("Ġ"), t.id
    assert respelled  # without the space, some answers would not be a copy


def _contains(seq: list[int], run: list[int]) -> bool:
    return any(seq[k:k + len(run)] == run for k in range(len(seq) - len(run) + 1))


def test_make_marker_data_rejects_bad_selections(tmp_path, capsys):
    script = load_script("scripts/make_marker_data.py")
    base = ["--synth", str(tmp_path), "--out", str(tmp_path / "out")]
    for extra, message in ((["--templates", "maker_hq,hq_moon"], "unknown templates ['hq_moon']"),
                           (["--templates", "maker_hq", "--conversations"], "conversations have no templates"),
                           (["--kinds", "compare,riddle"], "unknown kinds ['riddle']"),
                           (["--kinds", "compare", "--templates", "maker_hq"], "give one"),
                           (["--balance-yes-no", "--conversations"], "not with --conversations"),
                           (["--held-out", str(tmp_path / "nowhere")], "no corpus.jsonl there")):
        with pytest.raises(SystemExit):
            script.main(base + extra)
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_focus_sets_by_kind_and_balanced_yes_no_answers():
    """``select`` (``make_marker_data.py --kinds/--balance-yes-no``): traces of the kinds asked for,
    in order, and no more "no" than "yes" answers among the yes/no traces actually built (a
    question without a trace counts for neither)."""
    select = load_script("scripts/make_marker_data.py").select
    recs = [{"kind": k, "answer": a, "template": "t"} for k, a in
            [("chain", "X"), ("yesno", "no"), ("compare", "A"), ("yesno", "yes"), ("yesno", "no"),
             ("yesno", "yes"), ("yesno", "no"), ("no_retrieval", "4"), ("yesno", "no")]]
    built = [(r, f"trace {i}") for i, r in enumerate(recs)]
    built[5] = (recs[5], None)  # a "yes" question no query supported: one "yes" trace, so one "no"
    assert select(built, None, None, False) == [f"trace {i}" for i in (0, 1, 2, 3, 4, 6, 7, 8)]
    assert select(built, None, {"compare", "yesno"}, False) == [f"trace {i}" for i in (1, 2, 3, 4, 6, 8)]
    assert select(built, None, {"compare", "yesno"}, True) == ["trace 1", "trace 2", "trace 3"]
    assert select(built, None, None, True) == [f"trace {i}" for i in (0, 1, 2, 3, 7)]
    assert select(built, {"other"}, None, False) == []


def test_collate_and_loss_ignore_masked_tokens():
    batch = [{"input_ids": [5, 6, 7, 8, 9], "mask": [0, 0, 1, 0, 1]}, {"input_ids": [5, 6], "mask": [0, 1]}]
    b = collate(batch, pad_id=0, max_len=16)
    assert b["labels"].tolist() == [[IGNORE, IGNORE, 7, IGNORE, 9], [IGNORE, 6, IGNORE, IGNORE, IGNORE]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    logits = torch.randn(2, 5, 12, requires_grad=True)
    masked_loss(logits, b["labels"]).backward()
    # only positions that predict a mask-1 token get gradient
    predicting = (b["labels"][:, 1:] != IGNORE)
    grad_rows = logits.grad[:, :-1].abs().sum(-1) > 0
    assert torch.equal(grad_rows, predicting) and logits.grad[:, -1].abs().sum() == 0


def test_answer_weight_scales_the_answer_tokens_in_the_loss():
    """``answer_weight`` w: the answer (after the last unlabelled token) counts w times in the
    weighted mean; at 1 the batch has no weights and the loss is the plain masked mean."""
    batch = [{"input_ids": [5, 6, 7, 8, 9, 10], "mask": [0, 1, 1, 0, 1, 1]}, {"input_ids": [5, 6, 7], "mask": [0, 1, 1]}]
    assert [answer_start(t["mask"]) for t in batch] == [4, 1] and answer_start([1, 1]) == 0
    assert "weights" not in collate(batch, pad_id=0, max_len=16)
    b = collate(batch, pad_id=0, max_len=16, answer_weight=3.0)
    assert b["weights"][0].tolist()[:6] == [1, 1, 1, 1, 3, 3] and b["weights"][1].tolist()[:3] == [1, 3, 3]
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    hidden = model.get_decoder()(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    labels = b["labels"][:, 1:]
    keep = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(model.lm_head(hidden[:, :-1][keep]).float(), labels[keep], reduction="none")
    w = torch.tensor([1.0, 1.0, 3.0, 3.0, 3.0, 3.0])  # labelled tokens 6, 7 | 9, 10 (answer) ; 6, 7 (answer)
    torch.testing.assert_close(forward_loss(model, b), (ce * w).sum() / w.sum())
    plain = collate(batch, pad_id=0, max_len=16)
    torch.testing.assert_close(forward_loss(model, plain), ce.mean())


def test_a_non_positive_answer_weight_is_refused(tmp_path, capsys):
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="answer_weight must be > 0"):
            TrainConfig(answer_weight=bad)
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"input_ids": [5, 6], "mask": [0, 1], "variant": "special", "system_prompt": "s",
                                "marker_token_ids": [], "style": "special_token"}) + "\n")
    with pytest.raises(SystemExit):
        load_script("scripts/train_markers.py").main(["--data", str(data), "--out", str(tmp_path / "o"),
                                                       "--answer-weight", "0"])
    assert "answer_weight must be > 0, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_micro_batches_give_the_whole_batchs_loss_and_gradient():
    """A batch split by ``max_batch_tokens`` (parts cut to their own length) gets the same summed
    loss and the same gradient as the whole batch, with and without answer weights."""
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    rng = random.Random(1)
    traces = [{"input_ids": [rng.randrange(5, 60) for _ in range(n)], "mask": [0, 1, 1, 0] + [1] * (n - 4)}
              for n in (14, 12, 9, 6, 5)]  # a query, evidence, an answer: weights differ within a row
    for weight in (1.0, 2.5):
        batch = collate(traces, pad_id=0, max_len=32, answer_weight=weight)
        parts = micro_batches(batch, max_tokens=30)  # 14 columns: two rows a part
        assert [p["input_ids"].shape for p in parts] == [(2, 14), (2, 9), (1, 5)]
        grads = []
        for chunks in ([batch], parts):
            model.zero_grad()
            total, loss = loss_weight(batch), 0.0
            for part in chunks:
                part_loss = forward_loss(model, part, total)
                part_loss.backward()
                loss += part_loss.item()
            grads.append((loss, [p.grad.clone() for p in model.parameters()]))
        (whole, g_whole), (split, g_split) = grads
        assert abs(whole - split) < 1e-5 and abs(whole - forward_loss(model, batch).item()) < 1e-5
        for a, b in zip(g_whole, g_split):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert micro_batches(batch, None) == [batch] and len(micro_batches(batch, 10**6)) == 1
    weights = []
    for max_tokens in (None, 30):  # train() itself: the same weights after a few steps, split or not
        model = tiny_model(len(tok))
        model = wrap_lora(model, TrainConfig(rank=4, alpha=8, top_layers=1.0))
        train(model, traces, 0, TrainConfig(steps=3, batch_size=5, lr=1e-2, warmup=1, top_layers=1.0,
                                             answer_weight=2.5), max_batch_tokens=max_tokens)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    for n, p in weights[0].items():
        torch.testing.assert_close(p, weights[1][n], atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(p, 0 * p) for n, p in weights[0].items() if "lora_B" in n)  # it did train


def test_training_a_few_steps_lowers_the_loss(world):
    splits, retriever = world
    tok = tiny_tokenizer()
    builder = TraceBuilder(tok, retriever, "special", system_prompt="Search, then answer.", evidence_budget=48,
                           top_k=1, seed=0)
    traces = [t.to_json() for q in splits["train"][:24] if (t := builder.build(_rec(q)))]
    model = tiny_model(len(tok))
    added = add_marker_tokens(model, tok, __import__("rig_decode.markers").markers.MarkerSpec.special_token())
    assert added == traces[0]["marker_token_ids"] and len(tok) == len(variant_tokenizer(tiny_tokenizer(), "special"))
    base = model.get_input_embeddings().weight.detach().clone()
    model = wrap_lora(model, TrainConfig(rank=4, alpha=8, top_layers=1.0), added)
    cfg = TrainConfig(steps=40, batch_size=4, lr=3e-3, warmup=2, log_every=5, seed=0, top_layers=1.0)
    result = train(model, traces, tok.pad_token_id, cfg)
    assert result.losses[-1] < 0.8 * result.losses[0], result.losses
    merged = model.merge_and_unload().get_input_embeddings().weight
    changed = (merged - base).abs().sum(-1) > 0
    assert changed[added].all() and changed.sum() == len(added), "only the marker rows may train"


def test_forward_loss_is_the_masked_loss_and_top_layers_stop_backprop():
    """The trainer's loss (vocabulary projection at labelled positions only) equals the masked loss
    of the full logits; with ``top_layers`` < 1 only the top layers get LoRA and no gradient reaches
    the layers below (the untied input rows of the marker tokens stay put, the output rows learn)."""
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    added = add_marker_tokens(model, tok, __import__("rig_decode.markers").markers.MarkerSpec.special_token())
    cfg = TrainConfig(rank=4, alpha=8, top_layers=0.5)
    model = wrap_lora(model, cfg, added)
    lora_layers = {int(n.split(".layers.")[1].split(".")[0]) for n, _ in model.named_parameters() if "lora_A" in n}
    assert lora_layers == {1}
    batch = collate([{"input_ids": [5, 6, added[0], 7, added[1], 9], "mask": [0, 0, 1, 1, 1, 0]},
                     {"input_ids": [5, 8, 9, 10], "mask": [0, 1, 1, 1]}], pad_id=0, max_len=16)
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(forward_loss(model, batch), masked_loss(full, batch["labels"]))

    seen = {}
    layers = model.get_base_model().get_decoder().layers
    grab = layers[0].register_forward_hook(lambda _m, _a, out: seen.update(h=out[0] if isinstance(out, tuple) else out)
                                           or seen["h"].retain_grad())
    for top, reaches_below in ((1.0, True), (0.5, False)):
        stop = stop_backprop_below(model, TrainConfig(top_layers=top))
        model.zero_grad()
        forward_loss(model, batch).backward()
        assert (seen["h"].grad is not None) == reaches_below
        if stop is not None:
            stop.remove()
    grab.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if "trainable_tokens_delta" in n}
    assert any("lm_head" in n and g is not None and g.abs().sum() > 0 for n, g in grads.items())
    assert all(g is None or g.abs().sum() == 0 for n, g in grads.items() if "embed_tokens" in n)


def test_continuing_an_every_layer_adapter_on_the_top_half_trains_only_the_top_half():
    """``--resume`` of an adapter over every layer with ``--top-layers 0.5``: the lower layers'
    LoRA weights are frozen (no gradient, no kept activations) and stay as they were."""
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), layers=4)
    model = wrap_lora(model, TrainConfig(rank=4, alpha=8, top_layers=1.0))
    with torch.no_grad():  # LoRA B starts at zero: give every layer a non-trivial adapter first
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    rng = random.Random(0)
    traces = [{"input_ids": [rng.randrange(5, 60) for _ in range(12)], "mask": [0] * 4 + [1] * 8} for _ in range(8)]
    result = train(model, traces, 0, TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup=1, top_layers=0.5, seed=0))
    moved = {int(n.split(".layers.")[1].split(".")[0]) for n, p in model.named_parameters()
             if "lora_" in n and not torch.equal(p, before[n])}
    assert moved == {2, 3}
    frozen = {int(n.split(".layers.")[1].split(".")[0]) for n, p in model.named_parameters()
              if "lora_" in n and not p.requires_grad}
    assert frozen == {0, 1}  # out of the optimiser and the checkpoints
    assert result.trainable_params == sum(p.numel() for n, p in model.named_parameters()
                                          if "lora_" in n and int(n.split(".layers.")[1].split(".")[0]) >= 2)


def _rec(q) -> dict:
    return {"id": q.id, "question": q.question, "answer": q.answer, "hops": q.hops, "template": q.template,
            "supporting_docs": q.supporting_docs, "needs_retrieval": q.needs_retrieval, "entities": q.entities}


def test_training_starts_from_the_bare_model_not_the_shipped_adapter():
    """``model.adapter: auto`` merges the shipped marker adapter into the embedded model; a new
    adapter trained on top of that would later be applied to the bare model. ``load_base`` loads
    the bare weights, trainable."""
    from rig_decode.config import ModelConfig
    from rig_decode.models.loader import load_model
    from rig_decode.train.lora import load_base

    base, base_tok = load_base("smollm2-135m-instruct")
    bare, bare_tok = load_model(ModelConfig(name="smollm2-135m-instruct", adapter=None, cpu_gemm="torch", device="cpu"))
    shipped, _ = load_model(ModelConfig(name="smollm2-135m-instruct", cpu_gemm="torch", device="cpu"))
    assert len(base_tok) == len(bare_tok) < len(shipped.get_input_embeddings().weight)
    q = "model.layers.29.self_attn.q_proj.weight"
    weights = {n: dict(m.named_parameters())[q] for n, m in (("base", base), ("bare", bare), ("shipped", shipped))}
    assert torch.equal(weights["base"], weights["bare"]) and not torch.equal(weights["base"], weights["shipped"])
    assert type(base.model.layers[29].self_attn.q_proj) is torch.nn.Linear  # plain, trainable (not packed)


def test_a_resumed_adapter_lists_every_stage_it_went_through():
    script = load_script("scripts/train_markers.py")
    first = {"data": "a.jsonl", "traces": 10, "config": {"steps": 200, "lr": 3e-4},
             "result": {"losses": [4.61, 1.0, 0.27], "seconds": 2163.4}}
    second = {"data": "a.jsonl,b.jsonl", "traces": 30, "config": {"steps": 150, "lr": 1e-4},
              "result": {"losses": [0.593, 0.241], "seconds": 1229.0}}
    card = script.stages_card([script.stage(first), script.stage(second)])
    assert card.splitlines()[2:] == [
        "  1. `a.jsonl` (10 traces): 200 steps, lr 0.0003, 2163 s, loss 4.610 -> 0.270",
        "  2. `a.jsonl,b.jsonl` (30 traces): 150 steps, lr 0.0001, 1229 s, loss 0.593 -> 0.241"]


def test_a_run_stopped_midway_continues_from_its_checkpoint_to_the_same_result(world, tmp_path):
    """Stopped after its 12th step (the checkpoint at 10 survives), the same run started again
    continues from step 10 and ends with the weights and losses of an uninterrupted run."""
    splits, retriever = world
    tok = tiny_tokenizer()
    builder = TraceBuilder(tok, retriever, "special", system_prompt="Search, then answer.", evidence_budget=48,
                           top_k=1, seed=0)
    traces = [t.to_json() for q in splits["train"][:16] if (t := builder.build(_rec(q)))]
    cfg = TrainConfig(steps=20, batch_size=4, lr=3e-3, warmup=2, log_every=4, seed=0, top_layers=1.0)

    def fresh():  # a tokenizer of its own: adding the markers changes it
        own = tiny_tokenizer()
        model = tiny_model(len(own))
        added = add_marker_tokens(model, own, __import__("rig_decode.markers").markers.MarkerSpec.special_token())
        return wrap_lora(model, TrainConfig(rank=4, alpha=8, top_layers=1.0), added)

    whole = fresh()
    expected = train(whole, traces, tok.pad_token_id, cfg)

    class Stop(Exception):
        pass

    def stop_at_12(step, loss, eta_s):
        assert eta_s >= 0
        if step == 12:
            raise Stop

    first = fresh()
    with pytest.raises(Stop):
        train(first, traces, tok.pad_token_id, cfg, stop_at_12, checkpoint=tmp_path, checkpoint_every=5)
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 10
    steps = []
    resumed = fresh()
    result = train(resumed, traces, tok.pad_token_id, cfg, lambda s, loss, eta: steps.append(s), checkpoint=tmp_path,
                   checkpoint_every=5)
    assert steps == [12, 16, 20] and result.losses == pytest.approx(expected.losses, abs=1e-6)
    for (n, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
    with pytest.raises(ValueError, match="checkpoint of another run"):
        train(fresh(), traces[:-1], tok.pad_token_id, cfg, checkpoint=tmp_path, checkpoint_every=5)


class _Fixed:
    """A stand-in retriever: fixed hits per query."""

    def __init__(self, hits: dict):
        self.hits = hits

    def search_batch(self, queries, top_k, filters=None):
        return [list(self.hits[q][:top_k]) for q in queries]


def test_a_query_is_taught_only_when_its_evidence_shows_the_document_and_the_answer():
    """Real paragraphs are long: a hit past the evidence budget is cut or left out of the block, and
    a trace must not teach an answer its evidence does not show."""
    filler = Hit("filler", "lorem ipsum " * 200, 2.0, "Filler")
    gold = Hit("gold", "Zed Works was founded by Ana Quell in a small town.", 1.0, "Zed Works")
    cut = Hit("gold", "Zed Works is a firm. " * 60 + "It was founded by Ana Quell.", 1.0, "Zed Works")
    rec = {"id": "q", "question": "Who founded Zed Works?", "answer": "Ana Quell", "hops": 1, "kind": "chain",
           "plan": [{"entity": "Zed Works", "doc": "gold", "queries": ["buried", "first"]}]}

    def build(hits, seed=0):
        builder = TraceBuilder(tiny_tokenizer(), _Fixed(hits), "text", evidence_budget=96, p_misleading=0.0,
                               p_empty=0.0, seed=seed)
        return builder, builder.build(rec)

    for seed in range(4):  # whichever phrasing is tried first, the one whose block shows the gold document
        _, trace = build({"buried": [filler, gold], "first": [gold, filler]}, seed)
        assert trace.queries == ["first"] and trace.evidence_docs[0][0] == "gold"
    builder, trace = build({"buried": [filler, gold], "first": [filler, gold]})
    assert trace is None and builder.stats.skipped == 1
    builder, trace = build({"buried": [cut], "first": [cut]})  # shown, but cut before the answer
    assert trace is None and builder.stats.skipped == 1
    _, trace = build({"buried": [cut], "first": [gold]})
    assert trace.queries == ["first"]


def test_the_training_script_needs_torch_transformers_and_peft_only(tmp_path):
    """A bare GPU machine has no serving stack: a tiny run of the script with pydantic, FAISS,
    BM25, FastAPI and ONNX Runtime made unimportable trains and writes its adapter."""
    tok = tiny_tokenizer()
    tiny_model(len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    markers = [len(tok), len(tok) + 1]  # the ids add_marker_tokens gives the two delimiters
    rng = random.Random(0)
    with (tmp_path / "traces.jsonl").open("w") as f:
        for _ in range(8):
            ids = [rng.randrange(3, len(tok)) for _ in range(20)] + [markers[0], 5, 6, markers[1], 7, 2]
            f.write(json.dumps({"variant": "special", "style": "special_token", "kind": "plain",
                                "system_prompt": "Search, then answer.", "input_ids": ids,
                                "mask": [0] * 20 + [1] * 6, "marker_token_ids": markers}) + "\n")
    blocked = ["pydantic", "faiss", "bm25s", "fastapi", "onnxruntime", "prometheus_client"]
    code = f"import runpy, sys\nsys.modules.update(dict.fromkeys({blocked!r}))\nsys.argv = sys.argv[1:]\n" \
           "runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts" / "train_markers.py"),
                           "--data", str(tmp_path / "traces.jsonl"), "--out", str(tmp_path / "adapter"),
                           "--model", str(tmp_path / "model"), "--steps", "2", "--batch-size", "4",
                           "--top-layers", "1.0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["train"]["steps"] == 2
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
