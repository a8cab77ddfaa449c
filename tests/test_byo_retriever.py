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
