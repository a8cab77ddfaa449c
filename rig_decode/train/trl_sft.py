"""LoRA SFT of marker traces on TRL's ``SFTTrainer`` (``train_markers.py --trainer trl``).

The same stage as ``lora.train`` (same traces, loss mask, LoRA layout, optimiser, schedule shape,
gradient clip, seed), run by TRL and the transformers ``Trainer`` under it: several devices through
``accelerate launch`` (DDP; on CPU over gloo), packing, checkpoints and resume, progress, logging.

* **The engine's loss mask is TRL's completion mask.** A trace is pre-tokenised (``input_ids`` as
  the decoder sees them, evidence blocks included) with ``completion_mask`` = the trace's mask, and
  ``completion_only_loss``: TRL turns it into labels, -100 on the prompt and on every evidence
  token. The loss is the mean over labelled tokens of the whole batch, across devices
  (``average_tokens_across_devices``), as in ``lora.train``.
* **What stays by hand.** ``answer_weight`` != 1 (a per-token weight in the loss: TRL's loss has
  none) and ``max_batch_tokens`` (memory by micro-batches of one batch; on TRL use
  ``gradient_accumulation_steps`` instead) are refused here. The backprop stop below the LoRA layers
  (``top_layers`` < 1) is the same hook.
* **The loop's batches, in the loop's order, on the loop's schedule.** Unpacked, the trainer draws
  ``lora.length_batches`` in ``lora.next_batch``'s seeded order (``LoopBatches``; each global batch
  split over the processes) and steps the learning rate by ``lora.lr_factor``: one process trains
  on what the loop trains on, step for step, so the two runs differ only by the two code paths'
  rounding. Packed rows (``packing``) are the ``Trainer``'s own batches and cosine.
* **The loss is the loop's**, computed here, not by TRL's fused LM head: that head reads
  ``lm_head.weight`` directly, which misses (and, on peft's wrapper, fails over) the trained rows of
  the new marker tokens. The forward runs through the wrapped model (DDP's hooks see it), and a
  pre-hook on the output projection hands it only the positions that predict a kept label (a trace's
  labelled tokens are a tenth of it). With full logits and TRL's default gradient checkpointing, a
  step on 1,536-token traces took 3.3x the loop's (1.64x on short ones); without both, about the
  loop's. TRL's entropy and token-accuracy metrics are not logged.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .lora import (TrainConfig, TrainResult, freeze_below, kept_targets, length_batches, lr_factor, next_batch,
                   stop_backprop_below)


def traces_dataset(traces: list[dict]):
    """The traces as a pre-tokenised TRL dataset: ``input_ids`` and ``completion_mask``."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [t["input_ids"] for t in traces],
                              "completion_mask": [t["mask"] for t in traces]})


def world_size() -> int:
    """Processes of this run (``accelerate launch`` / ``torchrun`` set ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class LoopBatches:
    """A batch sampler of the loop's batches (``lora.length_batches`` in ``lora.next_batch``'s order
    from ``seed``), ``steps`` of them, each split into ``world`` consecutive parts: under DDP
    process ``p`` takes every ``world``-th batch from the ``p``-th (accelerate's sharding), which is
    part ``p`` of each global batch."""

    def __init__(self, traces: list[dict], batch_size: int, steps: int, seed: int, world: int = 1):
        self.batches = length_batches(traces, batch_size, min_rows=world)
        self.steps, self.seed, self.world = steps, seed, world

    def __iter__(self):
        rng, queue = random.Random(self.seed), []
        for _ in range(self.steps):
            batch = next_batch(self.batches, queue, rng)
            size, extra = divmod(len(batch), self.world)
            for p in range(self.world):
                start = p * size + min(p, extra)
                yield batch[start : start + size + (p < extra)]

    def __len__(self) -> int:
        return self.steps * self.world


def sft_trainer(model, tokenizer, traces: list[dict], cfg: TrainConfig, out: Path, *, checkpoint_every: int = 25,
                packing: bool = False, progress: bool = True):
    """An ``SFTTrainer`` for ``model`` (already wrapped by ``lora.wrap_lora`` or a resumed
    ``PeftModel``) on ``traces``; ``cfg.batch_size`` is the global batch, split over the processes.
    Checkpoints go to ``out/checkpoint`` every ``checkpoint_every`` steps."""
    from trl import SFTConfig, SFTTrainer

    if cfg.answer_weight != 1.0:
        raise ValueError("--answer-weight weights tokens in the loss, which TRL's loss cannot: use --trainer loop")
    world = world_size()
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} does not split over {world} processes")
    cpu = not torch.cuda.is_available()
    args = SFTConfig(
        output_dir=str(out / "checkpoint"), max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size // world,
        learning_rate=cfg.lr, lr_scheduler_type="cosine", warmup_steps=cfg.warmup, weight_decay=0.0,
        max_grad_norm=1.0, seed=cfg.seed, data_seed=cfg.seed, logging_steps=cfg.log_every,
        save_steps=checkpoint_every, save_total_limit=1, completion_only_loss=True, max_length=cfg.max_len,
        packing=packing, train_sampling_strategy="group_by_length", use_cpu=cpu, bf16=False, fp16=False, report_to=[],
        gradient_checkpointing=False,  # as the loop (TRL's default recomputes every forward in the backward)
        ddp_backend="gloo" if cpu and world > 1 else None, disable_tqdm=not progress, dataset_num_proc=None,
    )
    _check_identity(out / "checkpoint", {"config": asdict(cfg), "traces": len(traces),
                                         "first": traces[0]["input_ids"][:32], "packing": packing})
    freeze_below(model, cfg)
    pad = tokenizer.pad_token if tokenizer.pad_token is not None else tokenizer.eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = pad
    trainer = _trainer_class(SFTTrainer)(model=model, args=args, train_dataset=traces_dataset(traces),
                                         processing_class=tokenizer)
    if not packing:  # the loop's batches and schedule (see the module docstring)
        trainer.loop_batches = LoopBatches(traces, cfg.batch_size, cfg.steps, cfg.seed, world)
        trainer.loop_schedule = lr_factor(cfg)
    return trainer


def _check_identity(folder: Path, identity: dict) -> None:
    """Checkpoints in ``folder`` belong to this run (same settings and data), or there are none: a
    run's ``identity.json`` is written beside them, and a checkpoint of another run is refused (TRL
    would resume any)."""
    path, identity = folder / "identity.json", json.loads(json.dumps(identity))  # tuples as JSON lists
    if any(folder.glob("checkpoint-*")) and path.is_file() and json.loads(path.read_text()) != identity:
        raise ValueError(f"{folder} holds checkpoints of another run (other data or settings): delete it to start "
                         "afresh, or resume with the same arguments")
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(identity))


def _trainer_class(base):
    from transformers import Trainer

    class MarkerSFTTrainer(base):
        """``SFTTrainer`` whose loss is the loop's (``lora.forward_loss``): the model's forward through
        the wrapped model (DDP's included), the output projection applied only where a label is kept,
        the sum over the whole batch's labelled tokens divided by their count (see the module docstring)."""

        loop_batches: LoopBatches | None = None  # set by sft_trainer unless packed
        loop_schedule = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model_accepts_loss_kwargs = True  # compute_loss divides by the batch's labelled tokens itself

        def get_train_dataloader(self):
            if self.loop_batches is None:
                return super().get_train_dataloader()
            from torch.utils.data import DataLoader

            data = self._remove_unused_columns(self.train_dataset, description="training")
            loader = DataLoader(data, batch_sampler=self.loop_batches, collate_fn=self.data_collator,
                                num_workers=self.args.dataloader_num_workers)
            return self.accelerator.prepare(loader)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.loop_schedule is None or self.lr_scheduler is not None:
                return super().create_scheduler(num_training_steps, optimizer)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, self.loop_schedule)
            return self.lr_scheduler

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs:  # evaluation wants the outputs: the plain forward, full logits
                inputs["use_cache"] = False
                return Trainer.compute_loss(self, model, inputs, return_outputs=True,
                                            num_items_in_batch=num_items_in_batch)
            inputs = dict(inputs)
            keep, targets = kept_targets(inputs.pop("labels"))
            head = self.accelerator.unwrap_model(model).get_output_embeddings()  # (peft passes it through)
            # the head sees the positions that predict a kept label, not all of them
            hook = head.register_forward_pre_hook(lambda _, args: (args[0][:, :-1][keep], *args[1:]))
            try:
                logits = model(**inputs, use_cache=False).logits
            finally:
                hook.remove()
            total = keep.sum() if num_items_in_batch is None else num_items_in_batch
            loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum") / total
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes  # the Trainer averages the processes' losses
            return loss

    return MarkerSFTTrainer


def train_trl(trainer, cfg: TrainConfig) -> TrainResult:
    """Run ``trainer`` to ``cfg.steps``, continuing from the last checkpoint in its output folder
    if there is one; the loss history (one figure per ``log_every`` steps), time, parameter count."""
    from transformers.trainer_utils import get_last_checkpoint

    model = trainer.model
    folder = Path(trainer.args.output_dir)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    stop = stop_backprop_below(model, cfg)
    t0 = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=last)
    finally:
        if stop is not None:
            stop.remove()
        model.eval()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return TrainResult(losses=losses, seconds=time.perf_counter() - t0, trainable_params=params)
