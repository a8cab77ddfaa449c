"""``model.generate()`` with retrieval: ``rig_decode.hf.generate`` and the shipped ``custom_generate``
folder, against the engine as ``RigSession`` runs it."""

import pytest
import torch

from rig_decode.hf import CUSTOM_GENERATE, RigGenerateOutput, generate
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ForceScript, ScriptedRetriever
from .test_exactness import PROMPTS, _script
from .test_remote import _engine, _generate


def _padded(tok, prompts):
    rows = [tok.encode(p) for p in prompts]
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left padding, as for generate
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_generate_gives_the_engines_tokens_and_hops_on_a_ragged_batch(model, tok, monkeypatch):
    """``model.generate(custom_generate=...)`` on two prompts of different lengths, left-padded: each
    row's tokens after its input are the engine's, and so are its hops (the tiny model writes no
    markers: a script forces them, in both)."""
    import rig_decode.engine
    from rig_decode import RigConfig

    script = _script(MarkerVocab(tok, MarkerSpec.special_token()), tok.eos_token_id)
    local = _generate(_engine(model, tok, script, max_new_tokens=40), tok, PROMPTS[:2])
    ids, mask = _padded(tok, PROMPTS[:2])
    cfg = RigConfig().updated(rig={"max_iterations": 3, "evidence_token_budget": 64, "newline_ends_query": True},
                              retriever={"top_k": 2})
    real = rig_decode.engine.RigEngine

    class Scripted(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, extra_processors=[ForceScript(script)], **kwargs)

    monkeypatch.setattr(rig_decode.engine, "RigEngine", Scripted)
    out = model.generate(ids, attention_mask=mask, custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                         tokenizer=tok, retriever=ScriptedRetriever(), config=cfg, max_new_tokens=40,
                         return_dict_in_generate=True)
    assert isinstance(out, RigGenerateOutput) and out.sequences.shape[0] == 2
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
    for i, s in enumerate(local):
        tail = s.token_ids[len(s.prompt_ids):]
        assert out.sequences[i, ids.shape[1]: ids.shape[1] + len(tail)].tolist() == tail
        assert [st.query for st in out.traces[i].retrieval_steps] == [st.query for st in s.trace.retrieval_steps]
        assert out.masks[i] == s.mask[len(s.prompt_ids):]
    assert out["sequences"] is out.sequences


def test_unsupported_generate_arguments_are_refused_by_name(model, tok):
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    for kwargs, name in (({"num_beams": 4}, "num_beams"), ({"stopping_criteria": [object()]}, "stopping_criteria"),
                         ({"frobnicate": True}, "frobnicate")):
        with pytest.raises(ValueError, match=name):
            generate(model, ids, tokenizer=tok, retriever=ScriptedRetriever(), max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ids, retriever=ScriptedRetriever())
    out = generate(model, ids, tokenizer=tok, retriever=ScriptedRetriever(), max_new_tokens=4, num_beams=1)
    assert out.shape[0] == 1  # a no-op value of an unsupported argument is fine


def test_model_generate_with_custom_generate_on_the_embedded_default():
    """``model.generate(..., custom_generate=<shipped folder>, trust_remote_code=True)`` on the
    embedded default with its adapter: the tokens and hops of ``RigSession`` on the same prompt."""
    from rig_decode import RigConfig, RigSession
    from rig_decode.models.embedded import is_pulled
    from rig_decode.prompt import build_prompt

    if not is_pulled("smollm2-135m-instruct"):
        pytest.skip("embedded default model not pulled")
    cfg = RigConfig().updated(model={"max_tokens": 96})
    question = "Who founded the company that makes the Brisa T4?"
    with RigSession(cfg) as session:
        answer, trace = session.ask(question)
        model, tok, retriever = session.model, session.tokenizer, session.retriever
        prompt = build_prompt(tok, question, MarkerSpec.from_style(cfg.rig.marker_style), cfg.system_prompt())
        ids = torch.tensor([prompt])
        (seq,) = session.engine.generate([session.engine.new_sequence(prompt, max_new_tokens=96)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=CUSTOM_GENERATE,
                             trust_remote_code=True, tokenizer=tok, retriever=retriever, config=cfg,
                             max_new_tokens=96, return_dict_in_generate=True)
    assert [s.query for s in out.traces[0].retrieval_steps] == [s.query for s in trace.retrieval_steps]
    assert trace.num_hops >= 2 and out.traces[0].num_hops == trace.num_hops
    assert out.sequences[0].tolist() == seq.token_ids  # the session's engine on the same prompt, token for token
    assert answer in tok.decode(seq.token_ids[len(prompt):])
