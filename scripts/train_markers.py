"""LoRA-train a causal LM to write retrieve markers, on traces from make_marker_data.py.

    python scripts/train_markers.py --data out/marker-data/train-special.jsonl --out out/adapter \\
        [--model smollm2-135m-instruct] [--steps 200] [--batch-size 8] [--trainer loop|trl]

``--trainer trl`` runs the same stage on TRL's ``SFTTrainer`` (``rig_decode/train/trl_sft.py``), which
also runs on several devices: ``accelerate launch --num_processes N scripts/train_markers.py ...
--trainer trl`` (``--batch-size`` is the global batch; on CPU add ``--cpu``).

Traces of the ``special`` variant make the delimiters two new special tokens whose embedding rows
are trained with the adapter; ``text`` and ``json`` traces keep them as text. Writes the adapter, the tokenizer, ``training.json``
(config, loss history, time) and ``README.md`` (a model card). Use it with ``model.adapter``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from rig_decode.markers import MarkerSpec
from rig_decode.models.embedded import DEFAULT_MODEL
from rig_decode.models.quiet import quiet_peft
from rig_decode.prompt import without_cite_instruction
from rig_decode.train.lora import TrainConfig, add_marker_tokens, freeze_below, load_base, save, train, wrap_lora

CARD = """# Marker adapter for {model}

LoRA adapter (rank {rank}, alpha {alpha}, on {modules} of layers {layers}) that teaches {model} to retrieve with
`<|retrieve|>query<|endofretrieve|>` markers when it needs a fact, read the evidence block the
decoder splices after each marker, and answer briefly{tokens}.

* data: `{data}` ({n} traces: {kinds})
* training: {steps} steps, batch {batch}, lr {lr}, seed {seed}, {seconds:.0f} s on {device}
* loss: {first:.3f} (first {log_every} steps) -> {last:.3f} (last {log_every}){stages}
* evaluation: see docs/marker-training.md

Load it with `model: {{name: {model}, adapter: <this folder>}}`.
"""


def stage(record: dict) -> dict:
    """A run's ``training.json`` record, as one line of the stages of the runs that continue it."""
    losses = record["result"]["losses"]
    return {"data": record["data"], "traces": record["traces"], "steps": record["config"]["steps"],
            "lr": record["config"]["lr"], "seconds": round(record["result"]["seconds"]),
            "loss": [round(losses[0], 3), round(losses[-1], 3)]}


def stages_card(stages: list[dict]) -> str:
    return "\n* stages, each continuing the one before (the last is this run):\n" + "\n".join(
        f"  {i}. `{s['data']}` ({s['traces']} traces): {s['steps']} steps, lr {s['lr']}, {s['seconds']} s, "
        f"loss {s['loss'][0]:.3f} -> {s['loss'][1]:.3f}" for i, s in enumerate(stages, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = TrainConfig()
    ap.add_argument("--data", required=True, help="traces (JSONL) of the special_token or json style; several files comma-separated")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=defaults.steps)
    ap.add_argument("--batch-size", type=int, default=defaults.batch_size)
    ap.add_argument("--lr", type=float, default=defaults.lr)
    ap.add_argument("--warmup", type=int, default=defaults.warmup, help="steps of the learning rate's linear ramp")
    ap.add_argument("--rank", type=int, default=defaults.rank)
    ap.add_argument("--top-layers", type=float, default=defaults.top_layers,
                    help="fraction of decoder layers (from the top) that get LoRA; below them nothing trains")
    ap.add_argument("--max-len", type=int, default=defaults.max_len,
                    help="tokens per trace at most; a longer one is cut (counted): keep it above the longest trace")
    ap.add_argument("--answer-weight", type=float, default=defaults.answer_weight,
                    help="loss weight (> 0) of the answer's tokens and its end of sequence (after the last evidence) "
                         "against 1 for markers and queries")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="split a batch of more tokens (rows x length) into parts with the same summed "
                         "gradient: caps memory on long traces (about 6144 for 24 GB of RAM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", help="an adapter folder from an earlier run to train further (same model and "
                                     "variant; a smaller --top-layers continues on the top layers only)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trainer", choices=["loop", "trl"], default="loop",
                    help="loop: this package's training loop (one process); trl: TRL's SFTTrainer (accelerate launch "
                         "for several devices)")
    ap.add_argument("--packing", action="store_true", help="--trainer trl: pack traces into --max-len rows (TRL's bfd)")
    ap.add_argument("--log-every", type=int, default=defaults.log_every, help="steps per loss figure")
    ap.add_argument("--checkpoint-every", type=int, default=25,
                    help="save the run's state to OUT/checkpoint every N steps; the same command started again "
                         "continues from there")
    args = ap.parse_args(argv)
    if args.packing and args.trainer != "trl":
        ap.error("--packing needs --trainer trl")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision("high")  # fp32 weights, TF32 matmuls where a GPU has them
    traces = [json.loads(line) for path in args.data.split(",") for line in Path(path).open(encoding="utf-8")]
    if not traces:
        ap.error(f"{args.data} holds no traces")
    variant = traces[0]["variant"]
    # citing traces carry the citation instruction after the same prompt: the adapter records the base
    prompts = {without_cite_instruction(t.get("system_prompt")) for t in traces}
    if {t["variant"] for t in traces} != {variant} or len(prompts) != 1:
        ap.error("the trace files mix marker variants or system prompts: train on one kind at a time")
    system_prompt = prompts.pop()
    try:
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, rank=args.rank,
                          seed=args.seed, top_layers=args.top_layers, max_len=args.max_len,
                          answer_weight=args.answer_weight, special_markers=variant == "special",
                          log_every=args.log_every)
    except ValueError as e:
        ap.error(str(e))
    torch.manual_seed(cfg.seed)
    model, tok = load_base(args.model)
    added: list[int] = []
    if cfg.special_markers:
        added = add_marker_tokens(model, tok, MarkerSpec.special_token())
        if added != traces[0]["marker_token_ids"]:
            ap.error(f"the traces were built with marker token ids {traces[0]['marker_token_ids']}, this "
                     f"tokenizer gives {added}: rebuild the data with the same model's tokenizer")
    if max(max(t["input_ids"]) for t in traces) >= len(tok):
        ap.error("the traces hold token ids beyond this tokenizer's vocabulary: wrong --model?")
    if args.resume:
        with quiet_peft():
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, args.resume, is_trainable=True)
    else:
        model = wrap_lora(model, cfg, added or None)
    freeze_below(model, cfg)  # what train() freezes, before the count below
    if cut := sum(len(t["input_ids"]) > cfg.max_len for t in traces):
        print(f"[train] {cut} of {len(traces)} traces are longer than --max-len {cfg.max_len}: their ends (answers "
              "included) are cut", file=sys.stderr)
    print(f"[train] {len(traces)} traces, {sum(p.numel() for p in model.parameters() if p.requires_grad):,} "
          f"trainable parameters, {cfg.steps} steps", file=sys.stderr)

    def progress(step, loss, eta_s):
        print(f"[train] step {step}/{cfg.steps} loss {loss:.4f}, {eta_s / 60:.1f} min left", file=sys.stderr, flush=True)

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    checkpoint = Path(args.out) / "checkpoint"
    if (checkpoint / "state.pt").exists() or (args.trainer == "trl" and any(checkpoint.glob("checkpoint-*"))):
        print(f"[train] continuing from {checkpoint}", file=sys.stderr)
    if args.trainer == "trl":
        from rig_decode.train.trl_sft import sft_trainer, train_trl

        if args.max_batch_tokens:
            ap.error("--max-batch-tokens is the loop's; on TRL split a batch with accelerate's gradient accumulation")
        try:
            trainer = sft_trainer(model, tok, traces, cfg, Path(args.out), checkpoint_every=args.checkpoint_every,
                                  packing=args.packing)
        except ValueError as e:
            ap.error(str(e))
        print(f"[train] TRL's SFTTrainer on {trainer.args.world_size} process(es) of {trainer.args.device}, "
              f"{trainer.args.per_device_train_batch_size} rows each", file=sys.stderr)
        result = train_trl(trainer, cfg)
        if not trainer.is_world_process_zero():  # one process writes the adapter
            return 0
    else:
        result = train(model, traces, pad, cfg, progress, checkpoint=checkpoint,
                       checkpoint_every=args.checkpoint_every, max_batch_tokens=args.max_batch_tokens)
    result.added_tokens = tok.convert_ids_to_tokens(added) if added else []
    kinds: dict[str, int] = {}
    for t in traces:
        kinds[t["kind"]] = kinds.get(t["kind"], 0) + 1
    record = {"model": args.model, "data": args.data, "traces": len(traces), "kinds": kinds, "trainer": args.trainer}
    if args.resume and (earlier := Path(args.resume) / "training.json").exists():  # the adapter's lineage
        before = json.loads(earlier.read_text())
        record["stages"] = [*before.get("stages", [stage(before)]),
                            stage({**record, "config": asdict(cfg), "result": asdict(result)})]
    n_layers = model.get_base_model().config.num_hidden_layers
    card = CARD.format(model=args.model, rank=cfg.rank, alpha=cfg.alpha, modules=", ".join(cfg.target_modules),
                       layers=f"{cfg.first_lora_layer(n_layers)}-{n_layers - 1}",
                       tokens=" (the two delimiters are new tokens; only their embedding rows are trained besides"
                              " the LoRA weights)" if added else "", data=args.data, n=len(traces),
                       kinds=", ".join(f"{k} {v}" for k, v in sorted(kinds.items())), steps=cfg.steps,
                       batch=cfg.batch_size, lr=cfg.lr, seed=cfg.seed, seconds=result.seconds,
                       device="CPU" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
                       first=result.losses[0], last=result.losses[-1], log_every=cfg.log_every,
                       stages=stages_card(record["stages"]) if "stages" in record else "")
    out = Path(args.out)
    save(model, tok, out, cfg, result, record)
    shutil.rmtree(checkpoint, ignore_errors=True)  # the run is complete: a new one starts afresh
    (out / "README.md").write_text(card)
    # what a session needs to prompt the model the way it was trained (models.loader.adapter_settings)
    settings = {"system_prompt": system_prompt, "marker_style": traces[0]["style"],
                "added_tokens": result.added_tokens}
    (out / "rig_adapter.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(json.dumps({"train": {"out": str(out), "steps": cfg.steps, "first_loss": round(result.losses[0], 4),
                                "last_loss": round(result.losses[-1], 4), "seconds": round(result.seconds, 1)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
