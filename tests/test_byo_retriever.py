"""``retriever.type: python``: any retriever a user's code builds, from the config."""

import pytest

from rig_decode.config import ConfigError, RigConfig
from rig_decode.retrieval.base import RetrievalError
from rig_decode.retrieval.factory import build_retriever, demo_corpus_path

from .byo_helpers import KeywordStore


def _cfg(factory="tests.byo_helpers:KeywordStore", **args):
    return RigConfig.from_dict({"retriever": {"type": "python", "factory": factory,
                                              "factory_args": {"path": str(demo_corpus_path()), **args},
                                              "reranker": {"type": "none"}}})


def test_the_factory_builds_the_users_retriever_with_its_arguments():
    retriever = build_retriever(_cfg(min_overlap=2).retriever)
    assert isinstance(retriever, KeywordStore) and retriever.min_overlap == 2
    (hits,) = retriever.search_batch(["error E1001 fixed in release"], 2)
    assert hits[0].doc_id == "changelog-4.0.0"


@pytest.mark.parametrize("factory, message", [
    ("tests.byo_helpers:missing", "cannot be imported"),
    ("tests.no_such_module:make", "cannot be imported"),
    ("tests.byo_helpers:broken", "failed: ConnectionError: the vector store refused"),
    ("tests.byo_helpers:not_a_retriever", "returned a dict, which has no search_batch"),
])
def test_a_factory_that_cannot_give_a_retriever_is_a_clear_error_at_start(factory, message):
    with pytest.raises(RetrievalError, match=message) as e:
        build_retriever(_cfg(factory).retriever)
    assert factory in str(e.value)


@pytest.mark.parametrize("section, key", [
    ({"type": "python"}, "factory"),
    ({"type": "hybrid", "factory": "pkg.mod:make"}, "factory"),
    ({"type": "python", "factory": "not a path"}, "retriever.factory"),
])
def test_the_config_checks_type_and_factory_together(section, key):
    with pytest.raises(ConfigError, match=key):
        RigConfig.from_dict({"retriever": section})


def test_rig_ask_answers_a_demo_question_from_the_users_store():
    from rig_decode import RigSession
    from rig_decode.models.embedded import is_pulled

    if not is_pulled("smollm2-135m-instruct"):
        pytest.skip("embedded default model not pulled")
    cfg = _cfg().updated(model={"max_tokens": 96})
    with RigSession(cfg) as session:
        assert isinstance(session.retriever, KeywordStore)
        answer, trace = session.ask("Who founded the company that makes the Brisa T4?")
        calls = session.retriever.calls
    assert trace.num_hops >= 2 and calls >= 2, [s.query for s in trace.retrieval_steps]
    assert "Ilsa Varnik" in answer, (answer, [(s.query, [d.id for d in s.docs]) for s in trace.retrieval_steps])


@pytest.mark.parametrize("factory, module", [("tests.byo_helpers:langchain_store", "langchain_core"),
                                             ("tests.byo_helpers:llamaindex_store", "llama_index.core")],
                         ids=["langchain", "llamaindex"])
def test_rig_ask_answers_a_demo_question_from_a_framework_store(factory, module):
    """``retriever.type: python`` building a real LangChain in-memory vector store / LlamaIndex
    in-memory index over the demo corpus: the demo question is answered with its hops, each hop's
    documents mapped to hits with their ids and titles."""
    pytest.importorskip(module)
    from rig_decode import RigSession
    from rig_decode.models.embedded import is_pulled

    if not is_pulled("smollm2-135m-instruct"):
        pytest.skip("embedded default model not pulled")
    cfg = _cfg(factory).updated(model={"max_tokens": 96})
    with RigSession(cfg) as session:
        (hits,) = session.retriever.search_batch(["Brisa T4 manufacturer"], 2)
        answer, trace = session.ask("Who founded the company that makes the Brisa T4?")
    assert len(hits) == 2 and all(h.doc_id and h.title for h in hits)
    assert trace.num_hops >= 2, [s.query for s in trace.retrieval_steps]
    assert all(d.id and d.title for s in trace.retrieval_steps for d in s.docs)
    assert "Ilsa Varnik" in answer, (answer, [(s.query, [d.id for d in s.docs]) for s in trace.retrieval_steps])


def test_a_langchain_retriever_is_searched_in_one_batch_call():
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from rig_decode.retrieval.frameworks import LangChainRetriever

    calls = []

    class Fixed(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager=None):
            calls.append(query)
            return [Document(page_content=f"{query} {i}", metadata={"title": f"t{i}"}, id=f"{query}-{i}")
                    for i in range(3)]

    lc = LangChainRetriever(retriever=Fixed())
    out = lc.search_batch(["a", "b"], 2)
    assert [[h.doc_id for h in hits] for hits in out] == [["a-0", "a-1"], ["b-0", "b-1"]]
    assert [h.score for h in out[0]] == [1.0, 0.5] and out[0][0].title == "t0" and out[0][0].source == "langchain"
    assert sorted(calls) == ["a", "b"]
    with pytest.raises(RetrievalError, match="filters"):
        lc.search_batch(["a"], 2, {"namespace": "x"})
    with pytest.raises(RetrievalError, match="not a LangChain vector store"):
        LangChainRetriever(object())
