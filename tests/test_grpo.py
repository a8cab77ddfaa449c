"""GRPO through the engine (``rig_decode/train/grpo.py``): TRL's trainer scores exactly the ids the
engine sampled, and no evidence or forced token carries loss."""

import pytest
import torch

pytest.importorskip("trl")

from rig_decode.engine import EngineOptions, RigEngine  # noqa: E402
from rig_decode.markers import MarkerSpec  # noqa: E402
from rig_decode.prompt import build_prompt  # noqa: E402
from rig_decode.train.grpo import EngineRollout, answer_f1, format_reward  # noqa: E402
from rig_decode.train.lora import TrainConfig, add_marker_tokens, wrap_lora  # noqa: E402

from .helpers import ScriptedRetriever, tiny_model, tiny_tokenizer  # noqa: E402

QUESTIONS = ["Which release fixed error E1234?", "Who approved release 4.2.1?", "What priority does data loss get?"]
ANSWERS = ["4.2.1", "Priya Raman", "P1"]


def reply_length(completions, reply, **_) -> list[float]:
    """A reward that differs between a question's samples (a random model's F1 is 0 for all: no
    advantage, no update)."""
    return [len(r) / 10 for r in reply]


def _setup(tmp_path, steps: int = 1):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    add_marker_tokens(model, tok, MarkerSpec.special_token())
    policy = wrap_lora(model, TrainConfig(rank=4, alpha=8, top_layers=1.0))  # LoRA only (see grpo.py)
    # every rollout searches once (the first hop forced, its query the model's, cut at 6 tokens)
    opts = EngineOptions(max_iterations=2, retrieve_first=True, max_query_tokens=6, max_new_tokens=24,
                         evidence_token_budget=40, top_k=1, decode_step="hf")
    engine = RigEngine(policy.get_base_model(), tok, ScriptedRetriever(), opts)
    rollout = EngineRollout(engine, lambda q: build_prompt(tok, q, MarkerSpec.special_token(), "Answer."), seed=3)
    data = Dataset.from_dict({"prompt": QUESTIONS * 2, "answer": ANSWERS * 2, "needs_retrieval": [True] * 6})
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=steps, per_device_train_batch_size=4,
                      num_generations=2, learning_rate=1e-2, logging_steps=1, use_cpu=True, report_to=[],
                      temperature=1.0, beta=0.0, seed=0, save_strategy="no", disable_tqdm=True, bf16=False)
    trainer = GRPOTrainer(model=policy, reward_funcs=[answer_f1, format_reward, reply_length], args=args, train_dataset=data,
                          processing_class=tok, rollout_func=rollout)
    return trainer, rollout, engine, tok


def test_grpo_trains_on_the_ids_the_engine_sampled_and_no_evidence_carries_loss(tmp_path, monkeypatch):
    trainer, rollout, engine, tok = _setup(tmp_path)
    seen = []
    compute_loss = type(trainer).compute_loss

    def spy(self, model, inputs, *args, **kwargs):
        seen.append({k: inputs[k].clone() for k in ("completion_ids", "completion_mask", "tool_mask")})
        return compute_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(type(trainer), "compute_loss", spy)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    seqs = rollout.last
    assert len(seqs) == 4 and all(s.trace.num_hops >= 1 and s.evidence_spans for s in seqs)
    ids = torch.cat([b["completion_ids"] for b in seen])
    mask = torch.cat([b["completion_mask"] * b["tool_mask"] for b in seen])
    rows = list(range(len(ids)))  # TRL shuffles a generation batch before it scores it
    for s in seqs:
        n = len(s.token_ids) - len(s.prompt_ids)
        # the ids TRL scores are the engine's, sampled tokens and evidence alike
        row = next(r for r in rows if ids[r, :n].tolist() == s.token_ids[len(s.prompt_ids):])
        rows.remove(row)
        # loss only where the model sampled: every evidence token and every forced token has weight 0
        assert mask[row, :n].tolist() == s.mask[len(s.prompt_ids):]
        for a, b in s.evidence_spans:
            assert not mask[row, a - len(s.prompt_ids):b - len(s.prompt_ids)].any()
        assert mask[row, n:].sum() == 0
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert trainer.state.log_history[0]["rewards/reply_length/mean"] > 0


def test_rollout_ids_equal_the_engines_own_sampling(tmp_path):
    """The rollout at a step is a plain engine run with the rollout's seeds: the same ids again."""
    trainer, rollout, engine, tok = _setup(tmp_path)

    class State:
        global_step = 0

    class Fake:
        state, args = State(), trainer.args
        accelerator = trainer.accelerator

    prompts = [q for q in QUESTIONS for _ in range(2)]
    out = rollout(prompts, Fake())
    seeds = rollout.seeds(len(prompts), 0)
    assert len(set(seeds)) == len(seeds)
    with torch.no_grad():
        again = [engine.new_sequence(rollout.prompt_ids(q), seq_id=i, temperature=1.0, seed=s, question=q)
                 for i, (q, s) in enumerate(zip(prompts, seeds))]
        engine.generate(again)
    assert out["completion_ids"] == [s.token_ids[len(s.prompt_ids):] for s in again]
    assert out["completion_ids"][0] != out["completion_ids"][1]  # two samples of one question differ
    assert out["searches"] == [s.trace.num_hops for s in again]


def test_a_rollout_after_an_optimiser_step_samples_from_the_new_weights(tmp_path):
    """The engine keeps the shared prompt prefix's KV across requests: a rollout after a step must not
    start from KV the old weights computed. Step 1's rollouts equal a fresh engine's on the trained
    weights with the same seeds."""
    trainer, rollout, engine, tok = _setup(tmp_path, steps=2)
    weights = {}  # the policy's LoRA weights as each rollout saw them
    call = rollout.__call__

    def snapshot(prompts, trainer):
        weights[trainer.state.global_step] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                                              if p.requires_grad}
        return call(prompts, trainer)

    trainer.rollout_func = snapshot
    trainer.train()
    seqs = rollout.last
    assert sorted(weights) == [0, 1] and any(not torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    with torch.no_grad():  # back to the weights step 1's rollout sampled with
        for n, p in trainer.model.named_parameters():
            if n in weights[1]:
                p.copy_(weights[1][n])
    fresh = RigEngine(engine.model.eval(), tok, ScriptedRetriever(), engine.opts)  # (training leaves it in train mode)
    with torch.no_grad():
        again = [fresh.new_sequence(list(s.prompt_ids), seq_id=i, temperature=1.0, seed=seed)
                 for i, (s, seed) in enumerate(zip(seqs, rollout.seeds(len(seqs), step=1)))]
        fresh.generate(again)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in again]


def test_rewards_score_the_visible_answer_and_the_format():
    assert answer_f1([None] * 2, reply=["Release 4.2.1", "no idea"], answer=["4.2.1", "P1"]) == [pytest.approx(2 / 3), 0.0]
    assert format_reward([None] * 3, marker_errors=[0, 1, 0], searches=[1, 1, 2],
                         needs_retrieval=[True, True, False]) == [0.0, -0.5, -0.5]


def test_stacked_adapters_are_the_first_merged_then_the_second(tmp_path):
    """The adapter a GRPO stage ships: the SFT adapter (LoRA and marker rows) and the GRPO LoRA trained
    on top of it, as one adapter whose merge gives the logits of merging one after the other."""
    from peft import PeftModel

    from rig_decode.train.grpo import stack_adapters

    tok = tiny_tokenizer()
    base = tiny_model(len(tok))
    marks = add_marker_tokens(base, tok, MarkerSpec.special_token())
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(1)

    def trained(peft_model):  # LoRA's B starts at zero: give every weight of the adapter a value
        with torch.no_grad():
            for p in peft_model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.05)
        return peft_model

    def merged(*adapters):
        model = type(base).from_pretrained(tmp_path / "base")
        for name in adapters:
            model = PeftModel.from_pretrained(model, tmp_path / name).merge_and_unload()
        return model

    trained(wrap_lora(merged(), TrainConfig(rank=4, alpha=8, top_layers=1.0), marks)).save_pretrained(tmp_path / "sft")
    trained(wrap_lora(merged("sft"), TrainConfig(rank=2, alpha=6, top_layers=1.0))).save_pretrained(tmp_path / "grpo")
    stack_adapters(tmp_path / "sft", tmp_path / "grpo", tmp_path / "both")
    ids = torch.tensor([[5, 9, marks[0], 40, 41, marks[1], 17]])
    with torch.no_grad():
        expected, got, sft_only = (merged(*names)(input_ids=ids).logits
                                   for names in (("sft", "grpo"), ("both",), ("sft",)))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert not torch.allclose(got, sft_only, atol=1e-3)  # the second adapter counts
