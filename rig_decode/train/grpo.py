"""GRPO whose rollouts run through the engine: TRL's ``GRPOTrainer`` with a ``rollout_func``.

Search-policy RL (Search-R1, R1-Searcher, ReSearch) trains on rollouts whose retrieved tokens are
part of the context but not of the loss. TRL takes exactly that: a ``rollout_func`` returns each
completion's token ids and an ``env_mask`` (1: a token the model sampled, 0: anything else), which
TRL folds into its loss mask as it does for tool results. So no loop of our own, only the rollout:

* **Through the engine.** Every prompt of the trainer's batch (TRL passes each one
  ``num_generations`` times) is one sequence of a ``RigEngine`` over the policy being trained: the
  peft model's base modules, whose LoRA layers the optimiser updates in place, so there are no
  weights to sync. The batch decodes together, continuously, each hop's evidence spliced into the
  KV cache (a hop costs the forward of its evidence, not of the whole context again).
* **The ids trained on are the ids sampled.** A completion is the engine's ``token_ids`` after the
  prompt: sampled tokens, the forced rest of a delimiter, evidence blocks, as the model saw them;
  TRL's forward over prompt + completion scores each sampled token in the context it was sampled
  in (the engine's splice equals a cache-free forward: ``tests/test_exactness.py``). Its
  ``env_mask`` is the engine's mask (1 only where the model sampled), so evidence and forced tokens
  carry no loss.
* **Sampling** at the trainer's ``temperature`` and ``top_p`` (TRL scores with that temperature), one
  generator per completion seeded from the run's seed, the step, the process and the index: a
  resumed run draws what the uninterrupted one drew. Before each rollout the engine drops the KV
  it keeps across requests (``RigEngine.weights_changed``: the shared prompt prefix, computed by
  the weights before the last optimiser step).

The policy is LoRA only (``lora.wrap_lora`` without token ids), on a model whose marker rows are
already learned (an SFT adapter merged): TRL scores tokens through a fused LM head that reads the
output matrix directly, which misses the trained rows peft keeps beside an embedding matrix
(``trainable_token_indices``; on an untied output matrix it fails outright).

Rewards (TRL reward functions; the rollout passes ``reply``, ``searches`` and ``marker_errors`` per
completion, the dataset ``answer`` and ``needs_retrieval``): ``answer_f1`` / ``answer_em`` of the
visible answer against the gold one, and ``format_reward``: -0.5 for a marker the engine could not
read, -0.5 for a search on a question that needs none.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..eval.metrics import exact_match, f1_score


class EngineRollout:
    """TRL's ``rollout_func`` over a ``RigEngine`` (see the module docstring). ``prompt_ids(q)``: a
    question's prompt as the engine would build it (``RigSession.prompt_ids``)."""

    def __init__(self, engine, prompt_ids: Callable[[str], list[int]], *, seed: int = 0,
                 max_new_tokens: int | None = None):
        self.engine, self.prompt_ids, self.seed, self.max_new_tokens = engine, prompt_ids, seed, max_new_tokens
        self.last: list = []
        """The sequences of the last call (their traces, for inspection and tests)."""

    def seeds(self, n: int, step: int, process: int = 0) -> list[int]:
        return rollout_seeds(self.seed, n, step, process)

    def __call__(self, prompts: list[str], trainer) -> dict:
        step, process, args = trainer.state.global_step, trainer.accelerator.process_index, trainer.args
        if args.top_k or args.min_p is not None or args.repetition_penalty != 1.0:
            raise ValueError("the engine samples with temperature and top_p only: leave top_k, min_p and "
                             "repetition_penalty at their defaults")
        self.engine.weights_changed()  # the optimiser moved the weights since the last rollout
        model = self.engine.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                seqs = [self.engine.new_sequence(self.prompt_ids(q), seq_id=i, question=q, temperature=args.temperature,
                                                 top_p=args.top_p, seed=seed, max_new_tokens=self.max_new_tokens)
                        for i, (q, seed) in enumerate(zip(prompts, self.seeds(len(prompts), step, process)))]
                self.engine.generate(seqs)
        finally:
            model.train(was_training)
        self.last = seqs
        return {
            "prompt_ids": [list(s.prompt_ids) for s in seqs],
            "completion_ids": [s.token_ids[len(s.prompt_ids):] for s in seqs],
            "logprobs": None,
            "env_mask": [s.mask[len(s.prompt_ids):] for s in seqs],
            "reply": [s.answer_text.strip() for s in seqs],
            "searches": [s.trace.num_hops for s in seqs],
            "marker_errors": [len(s.trace.marker_errors) for s in seqs],
        }


def rollout_seeds(seed: int, n: int, step: int, process: int = 0) -> list[int]:
    """The sampling seeds of ``n`` completions at ``step`` of a run seeded ``seed`` on ``process``
    (distinct over steps, processes and completions; the same on a resumed run)."""
    return [((seed * 1_000_003 + step) * 1_009 + process) * 100_003 + i for i in range(n)]


def answer_f1(completions, reply, answer, **_) -> list[float]:
    """Token F1 of each completion's visible answer against the gold ``answer`` (a string or a list)."""
    return [f1_score(r, _gold(a)) for r, a in zip(reply, answer)]


def answer_em(completions, reply, answer, **_) -> list[float]:
    return [exact_match(r, _gold(a)) for r, a in zip(reply, answer)]


def format_reward(completions, marker_errors, searches, needs_retrieval=None, **_) -> list[float]:
    """-0.5 for a marker the engine could not read; -0.5 for searching a question that needs no search."""
    needs = needs_retrieval if needs_retrieval is not None else [True] * len(completions)
    return [-0.5 * bool(e) - 0.5 * (bool(s) and not n) for e, s, n in zip(marker_errors, searches, needs)]


def _gold(answer) -> list[str]:
    return [answer] if isinstance(answer, str) else list(answer)


def stack_adapters(first: Path, second: Path, out: Path) -> None:
    """Write one LoRA adapter that applies ``first`` and then ``second`` (trained on the model with
    ``first`` merged): in every module, ranks side by side (the A matrices stacked, the B matrices
    side by side, each scaled by its adapter's alpha / r; the new alpha is the new rank, so the
    scale is 1), which is exactly the sum of the two updates; ``first``'s other weights (trained
    marker rows) are kept. ``model.adapter`` then loads the result like any adapter."""
    from safetensors.torch import load_file, save_file

    configs = [json.loads((Path(d) / "adapter_config.json").read_text()) for d in (first, second)]
    for c in configs:
        if c.get("peft_type") != "LORA" or c.get("use_rslora") or c.get("use_dora") or c.get("rank_pattern") \
                or c.get("alpha_pattern"):
            raise ValueError("stack_adapters takes plain LoRA adapters (one rank and alpha, no rsLoRA or DoRA)")
    w1, w2 = (load_file(str(Path(d) / "adapter_model.safetensors")) for d in (first, second))
    lora = [k for k in w2 if ".lora_A." in k or ".lora_B." in k]
    if set(w2) - set(lora) or set(lora) - set(w1):
        raise ValueError(f"{second} has weights {first} has no LoRA for: train it on the same modules")
    s1, s2 = (c["lora_alpha"] / c["r"] for c in configs)
    stacked = {}
    for k, v in w1.items():
        if ".lora_A." in k:
            other = w2.get(k, torch.zeros(configs[1]["r"], v.shape[1]))
            stacked[k] = torch.cat([v.float(), other.float()], 0)
        elif ".lora_B." in k:
            other = w2.get(k, torch.zeros(v.shape[0], configs[1]["r"]))
            stacked[k] = torch.cat([v.float() * s1, other.float() * s2], 1)
        else:
            stacked[k] = v
    rank = configs[0]["r"] + configs[1]["r"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in stacked.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({**configs[0], "r": rank, "lora_alpha": rank}, indent=2))
