"""End to end: every method on a tiny dataset with a tiny model and a real dense index."""

import json

from rig_decode import RigConfig
from rig_decode.eval.datasets import EvalExample
from rig_decode.eval.report import markdown_table, write_outputs
from rig_decode.eval.runner import EvalRunner, plan
from rig_decode.retrieval.base import Document
from rig_decode.config import RetrieverConfig
from rig_decode.retrieval.factory import build_retriever

EXAMPLES = [
    EvalExample("q1", "Which release fixed error E1234?", ["4.2.1"], ["d1"], True, 1),
    EvalExample("q2", "Who approved release 4.2.1?", ["Priya Raman"], ["d2"], True, 1),
    EvalExample("q3", "What is 2 plus 2?", ["4"], [], False, 0),
]
DOCS = [Document("d1", "Release 4.2.1 fixed error E1234."), Document("d2", "Priya Raman approved release 4.2.1."),
        Document("d3", "Bananas grow in the tropics.")]


def test_all_methods_end_to_end(model, tok, tmp_path):
    cfg = RigConfig().updated(model={"max_tokens": 12}, rig={"retrieve_first": True, "max_query_tokens": 4,
                                                             "evidence_token_budget": 48})
    retriever = build_retriever(RetrieverConfig(), cache_dir=tmp_path / "cache", corpus=DOCS)
    keys = plan(["none", "rag", "rig", "rig-reprefill"], [1, 2])
    results = EvalRunner(cfg, model, tok, retriever, batch_size=2, progress=False).run(EXAMPLES, keys)
    data = write_outputs(tmp_path, results, keys, {"dataset": "tiny", "command": "test", "model": "tiny",
                                                   "examples": 3, "corpus": "3 documents"})

    runs = data["runs"]
    assert list(runs) == ["none", "rag", "rig@1", "rig@2", "rig-reprefill@1", "rig-reprefill@2"]
    assert runs["none"]["hops_per_question"] == 0 and runs["none"]["retrieval_precision"] is None
    assert runs["rag"]["hops_per_question"] == 1 and runs["rag"]["unnecessary_retrieval_rate"] == 1.0
    assert runs["rig@1"]["hops_per_question"] == 1.0  # retrieve_first: every question hops once
    assert runs["rig@2"]["hops_per_question"] >= 1.0
    for mi in ("1", "2"):
        assert data["rig_vs_reprefill"][mi]["identical_answers"]
    assert all(0 <= runs[k]["accuracy"] <= 1 for k in runs)

    for name in ("report.md", "results.json", "traces.jsonl", "accuracy_vs_max_iterations.png",
                 "latency_vs_max_iterations.png"):
        assert (tmp_path / name).stat().st_size > 0
    lines = (tmp_path / "traces.jsonl").read_text().splitlines()
    assert len(lines) == 3 * len(keys)
    rec = json.loads(lines[-1])
    assert {"id", "method", "prediction", "em", "f1", "trace"} <= set(rec)
    assert "| rig@2 |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "accuracy_vs_max_iterations.png").read_bytes()[:4] == b"\x89PNG"


def test_conversation_eval_counts_redundant_retrieval(model, tok):
    """A model that writes the same query on every turn: with memory, the clarification's (and the
    follow-up's) repeated query is answered from context instead of searched again."""
    from rig_decode.config import RigConfig
    from rig_decode.eval.conversations import aggregate, run_conversations
    from rig_decode.eval.synth import generate

    from .helpers import ScriptedRetriever

    chats: dict = {}
    generate(seed=1, scale=0.34, conversations=chats)
    convs = chats["test"][:3]

    class SameQueryEveryTurn:
        """Writes the first turn's lookup query as a marker on every turn, then stops."""

        def __init__(self, engine, query):
            self.plan = engine.vocab.marker_token_ids(query) + [engine.stop_ids[0]]

        def apply(self, rows, scores):
            for i, seq in enumerate(rows):
                if seq.trace.question.startswith(("Thanks", "Great", "Hello", "Nice", "You're", "Good")):
                    continue  # chit-chat: the model's own (tiny, random) choice, which the gate judges
                k = min(seq.num_generated, len(self.plan) - 1)
                scores[i].fill_(float("-inf"))
                scores[i, self.plan[k]] = 0.0
            return scores

    cfg = RigConfig.from_dict({"rig": {"max_iterations": 1, "newline_ends_query": False, "citations": True,
                                       "gate": {"enabled": True}},
                               "model": {"max_tokens": 24}})
    import rig_decode.eval.conversations as C

    real = C.RigEngine

    class Scripted(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.processors.insert(0, SameQueryEveryTurn(self, "lookup query"))

    C.RigEngine = Scripted
    try:
        results = run_conversations(cfg, model, tok, ScriptedRetriever(), convs, ["rig", "rig+memory"],
                                    batch_size=4, progress=False)
    finally:
        C.RigEngine = real
    plain, memory = aggregate(results["rig"]["records"]), aggregate(results["rig+memory"]["records"])
    assert plain["clarification_retrieval_rate"] == 1.0  # searched the same thing again
    assert memory["clarification_retrieval_rate"] == 0.0  # referenced the first turn's documents
    assert memory["searches_per_conversation"] < plain["searches_per_conversation"]
    assert memory["reused_hops_per_conversation"] >= 2  # clarification and follow-up repeat the query
    assert memory["citation_validity"] in (None, 1.0)


def test_cache_variants_are_compared_with_rig(tok, tmp_path):
    """rig-summary and rig-zero-prefill run beside rig; on a one-layer model zero-prefill is exact
    (a piece's KV does not depend on what precedes it), so its answers must all match rig's."""
    from .helpers import one_layer_model

    model = one_layer_model(len(tok), seed=3)
    cfg = RigConfig().updated(model={"max_tokens": 24}, rig={"retrieve_first": True, "max_query_tokens": 4,
                                                             "evidence_token_budget": 48})
    retriever = build_retriever(RetrieverConfig(), cache_dir=tmp_path / "cache", corpus=DOCS)
    keys = plan(["rig", "rig-summary", "rig-zero-prefill", "rig-zero-prefill-deviation"], [2])
    results = EvalRunner(cfg, model, tok, retriever, batch_size=2, progress=False).run(EXAMPLES, keys)
    data = write_outputs(tmp_path, results, keys, {"dataset": "tiny", "command": "test", "model": "tiny",
                                                   "examples": 3, "corpus": "3 documents"})
    runs = data["runs"]
    assert list(runs) == ["rig@2", "rig-summary@2", "rig-zero-prefill@2", "rig-zero-prefill-deviation@2"]
    assert data["variants_vs_rig"]["rig-zero-prefill@2"]["same_answers"] == 1.0
    assert data["variants_vs_rig"]["rig-zero-prefill-deviation@2"]["same_answers"] == 1.0
    assert set(data["variants_vs_rig"]) == {"rig-summary@2", "rig-zero-prefill@2", "rig-zero-prefill-deviation@2"}
    assert runs["rig-summary@2"]["evidence_kept_per_question"] <= runs["rig@2"]["evidence_kept_per_question"]
    assert runs["rig@2"]["evidence_kept_per_question"] > 0 and runs["rig@2"]["splice_ms_per_hop"] > 0
    for key, select in ((keys[2], "tail"), (keys[3], "deviation")):
        zp = [st["info"]["zero_prefill"] for r in results[key]["records"] for st in r["trace"]["retrieval_steps"]]
        assert zp and all(z["reused_tokens"] > 0 and z["select"] == select for z in zp)
    assert "rig-summary@2 vs rig" in (tmp_path / "report.md").read_text()


def test_redundant_retrieval_counts_turns_whose_documents_were_at_hand():
    """A search is redundant on a turn that needs no document or only ones an earlier turn of the
    same conversation retrieved; not when the earlier search missed the document."""
    from rig_decode.eval.conversations import aggregate, redundant_turns

    def rec(conv, turn, kind, need, docs, searched, found=()):
        steps = [{"docs": [{"id": d} for d in found], "info": {}}] if searched else []
        return {"conversation": conv, "turn": turn, "kind": kind, "needs_retrieval": need, "supporting_docs": docs,
                "searches": int(searched), "reused": 0, "accuracy": 1.0 if need is not None else None,
                "citations": 0, "citations_valid": 0, "citations_supported": 0,
                "trace": {"retrieval_steps": steps}}

    records = [  # conversation a: the lookup found d1, so the detail's search is redundant
        rec("a", 0, "lookup", True, ["d1"], True, found=["d1", "d9"]),
        rec("a", 1, "clarification", False, ["d1"], False),
        rec("a", 2, "detail", True, ["d1"], True, found=["d1"]),
        rec("a", 3, "follow_up", True, ["d2"], True, found=["d2"]),
        # conversation b: the lookup missed d1, so searching for the detail is needed
        rec("b", 0, "lookup", True, ["d1"], True, found=["d7"]),
        rec("b", 2, "detail", True, ["d1"], True, found=["d1"]),
        rec("b", 1, "clarification", False, ["d1"], True, found=["d7"]),  # out of order on purpose
    ]
    assert [(r["conversation"], r["turn"]) for r in redundant_turns(records)] == [("a", 1), ("a", 2), ("b", 1)]
    summary = aggregate(records)
    assert summary["redundant_retrieval_rate"] == 2 / 3
    assert summary["detail_retrieval_rate"] == 1.0 and summary["clarification_retrieval_rate"] == 0.5
    assert summary["searches_per_conversation"] == 3.0


def test_a_table_of_runs_leaves_a_metric_an_older_run_lacks_blank():
    """compare_evals.py puts results.json files of different versions side by side."""
    new = {"n": 2, "exact_match": 0.5, "evidence_kept_per_question": 193.0}
    old = {"n": 2, "exact_match": 0.25}
    head, _, *rows = markdown_table({"new": new, "old": old}).splitlines()
    cells = [dict(zip(head.split(" | "), row.split(" | "))) for row in rows]
    assert [c["EM %"] for c in cells] == ["50.0", "25.0"]
    assert [c["evidence kept/q"] for c in cells] == ["193", "-"]


def test_an_engine_fault_is_scored_as_an_engine_error_not_a_bad_marker(model, tok, tmp_path):
    """A logits processor that raises on one question ends that question with an engine error:
    eval reports it as one (its own column) and counts no malformed marker for it."""
    cfg = RigConfig().updated(model={"max_tokens": 12}, rig={"retrieve_first": True, "max_query_tokens": 4,
                                                             "evidence_token_budget": 48})
    retriever = build_retriever(RetrieverConfig(), cache_dir=tmp_path / "cache", corpus=DOCS)

    class FailsOnQ2:
        def apply(self, rows, scores):
            if any(r.trace.question == EXAMPLES[1].question and r.num_generated == 3 for r in rows):
                raise RuntimeError("injected engine fault")
            return scores

    class FaultyEngines(EvalRunner):
        def _engine(self, key):
            engine = super()._engine(key)
            engine.processors.insert(0, FailsOnQ2())
            return engine

    keys = plan(["rig"], [1])
    results = FaultyEngines(cfg, model, tok, retriever, batch_size=2, progress=False).run(EXAMPLES, keys)
    data = write_outputs(tmp_path, results, keys, {"dataset": "tiny", "command": "test", "model": "tiny",
                                                   "examples": 3, "corpus": "3 documents"})
    by_id = {r["id"]: r for r in results[keys[0]]["records"]}
    assert by_id["q2"]["engine_errors"] == 1 and by_id["q2"]["markers_invalid"] == 0
    assert "injected engine fault" in by_id["q2"]["trace"]["engine_errors"][0]
    assert by_id["q1"]["engine_errors"] == 0 and by_id["q3"]["engine_errors"] == 0
    run = data["runs"]["rig@1"]
    assert run["engine_error_rate"] == 1 / 3 and run["marker_validity"] == 1.0
    table = (tmp_path / "report.md").read_text()
    assert "engine err. %" in table and "| 33.3 |" in table
