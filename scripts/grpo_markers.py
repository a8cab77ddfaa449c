"""A GRPO stage on a marker adapter, its rollouts through the engine (``rig_decode/train/grpo.py``).

    python scripts/grpo_markers.py --synth out/synth-s5 --out out/grpo-1 [--adapter auto] [--steps 100] \\
        [--prompts 4] [--generations 4] [--lr 1e-5] [--temperature 1.0] [--max-iterations 3] [--min-hops 0] [--max-hops N]

Questions come from a ``rig synth`` folder's ``train.jsonl`` only (its test and dev splits, and
every test world's documents, stay out: ``train.data.training_corpus``); the retriever is the
default hybrid one over that corpus. The policy is the model with ``--adapter`` merged (``auto``:
the adapter shipped for an embedded model) plus a new LoRA (``--rank``); every step samples
``--generations`` rollouts of each of ``--prompts`` questions through a ``RigEngine`` over the policy,
rewards them (answer F1, format; ``--reward-weights``) and takes one GRPO step (TRL). Checkpoints
go to ``OUT/checkpoint`` every ``--checkpoint-every`` steps; the same command started again continues
from the last one. OUT then holds one adapter: ``--adapter`` and the GRPO LoRA stacked
(``grpo.stack_adapters``), with ``rig_adapter.json`` and ``training.json``; load it with
``model.adapter: OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is what this script is about


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--synth", required=True, help="a `rig synth` folder: its train.jsonl and corpus.jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--adapter", default="auto", help="the marker adapter to continue (auto: the shipped one)")
    ap.add_argument("--model", default=None, help="the base model (default: the config's embedded default)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=4, help="questions per step")
    ap.add_argument("--generations", type=int, default=4, help="rollouts per question (GRPO's group)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--beta", type=float, default=0.0, help="KL weight against the starting policy")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-iterations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reward-weights", default="1,1", help="answer F1, format")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--min-hops", type=int, default=0,
                    help="only questions of at least this many hops (a group of rollouts that all answer right, or "
                         "all wrong, has no advantage: questions the adapter already gets right teach nothing)")
    ap.add_argument("--max-hops", type=int, default=None,
                    help="only questions of at most this many hops (more than --max-iterations: every rollout fails)")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.generations < 2 or args.temperature <= 0:
        ap.error("--prompts >= 1, --generations >= 2 (a group to compare) and --temperature > 0")

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer

    from rig_decode.config import RigConfig
    from rig_decode.engine import RigEngine
    from rig_decode.eval.datasets import load_dataset
    from rig_decode.markers import MarkerSpec
    from rig_decode.models.loader import adapter_path, load_model
    from rig_decode.prompt import build_prompt
    from rig_decode.retrieval.factory import build_retriever
    from rig_decode.session import engine_options
    from rig_decode.train.data import training_corpus
    from rig_decode.train.grpo import EngineRollout, answer_f1, format_reward, stack_adapters

    train_file = Path(args.synth) / "train.jsonl"
    if not train_file.is_file():
        ap.error(f"{train_file} not found: give a folder `rig synth` wrote")
    examples, corpus = load_dataset(train_file)
    if any(not str(e.id).startswith("train") for e in examples):
        ap.error(f"{train_file} holds questions of other splits: GRPO trains on training questions only")
    most = float("inf") if args.max_hops is None else args.max_hops
    examples = [e for e in examples if args.min_hops <= (e.hops or 0) <= most]
    if not examples:
        ap.error(f"no question of {train_file} has {args.min_hops} to {most} hops")
    # fp32 and plain linears (the packed CPU GEMM is for inference: it has no backward)
    model_cfg = {"adapter": args.adapter, "max_tokens": args.max_tokens, "dtype": "float32", "cpu_gemm": "torch"}
    if args.model:
        model_cfg["name"] = args.model
    cfg = RigConfig().updated(model=model_cfg, rig={"max_iterations": args.max_iterations})
    sft = adapter_path(cfg.model)
    if sft is None:
        ap.error("--adapter: GRPO continues a marker adapter (its marker rows are learned there)")
    torch.manual_seed(args.seed)
    model, tok = load_model(cfg.model)  # the adapter merged: the policy's starting point
    # a new LoRA on the modules the SFT adapter adapts (the two stack into one adapter at the end)
    sft_lora = json.loads((sft / "adapter_config.json").read_text())
    policy = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                              task_type="CAUSAL_LM", target_modules=sft_lora["target_modules"],
                                              layers_to_transform=sft_lora.get("layers_to_transform")))
    retriever = build_retriever(cfg.retriever, corpus=training_corpus(corpus))
    engine = RigEngine(policy.get_base_model(), tok, retriever,
                       engine_options(cfg, model, decode_step="hf", max_batch_size=args.prompts * args.generations))
    spec, system = MarkerSpec.from_style(cfg.rig.marker_style), cfg.system_prompt()
    rollout = EngineRollout(engine, lambda q: build_prompt(tok, q, spec, system), seed=args.seed)
    data = Dataset.from_dict({"prompt": [e.question for e in examples], "answer": [e.answers for e in examples],
                              "needs_retrieval": [e.needs_retrieval is not False for e in examples]})
    out = Path(args.out)
    grpo_args = GRPOConfig(
        output_dir=str(out / "checkpoint"), max_steps=args.steps, per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, learning_rate=args.lr, beta=args.beta, temperature=args.temperature,
        reward_weights=[float(w) for w in args.reward_weights.split(",")], logging_steps=1,
        save_steps=args.checkpoint_every, save_total_limit=1, seed=args.seed, use_cpu=not torch.cuda.is_available(),
        bf16=False, report_to=[])  # scored in fp32, as sampled
    trainer = GRPOTrainer(model=policy, reward_funcs=[answer_f1, format_reward], args=grpo_args, train_dataset=data,
                          processing_class=tok, rollout_func=rollout)
    last = get_last_checkpoint(grpo_args.output_dir) if Path(grpo_args.output_dir).is_dir() else None
    if last:
        print(f"[grpo] continuing from {last}", file=sys.stderr)
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=last)
    seconds = time.perf_counter() - t0
    engine.close()
    policy.save_pretrained(out / "grpo-lora", save_embedding_layers=False)  # LoRA only: stack_adapters takes it
    stack_adapters(sft, out / "grpo-lora", out)
    shutil.copy(sft / "rig_adapter.json", out / "rig_adapter.json")
    history = [h for h in trainer.state.log_history if "reward" in h]
    record = {"stage": "grpo", "adapter": str(args.adapter), "synth": args.synth, "questions": len(examples),
              "args": vars(args), "seconds": round(seconds),
              "rewards": [round(h["reward"], 4) for h in history],
              # groups whose rollouts all scored alike (no advantage: that step learned nothing from them)
              "frac_reward_zero_std": [round(h.get("frac_reward_zero_std", 0.0), 4) for h in history]}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    print(json.dumps({"grpo": {"out": str(out), "steps": args.steps, "first_reward": record["rewards"][0] if history else None,
                               "last_reward": record["rewards"][-1] if history else None, "seconds": round(seconds)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
