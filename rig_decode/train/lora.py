"""LoRA fine-tuning on marker traces (peft), with the engine's loss mask.

Two ways to treat the marker delimiters:

* ``special``: ``<|retrieve|>`` and ``<|endofretrieve|>`` become single new tokens; only their
  embedding rows are trained on top of the LoRA weights (peft's ``trainable_token_indices``), so
  the adapter stays small;
* ``text``: the delimiters stay ordinary text, split into several existing tokens.

Only tokens with mask 1 (what the model writes) contribute to the loss: prompt and evidence tokens
get label -100.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..markers import MarkerSpec

IGNORE = -100


@dataclass(slots=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    lr: float = 3e-4
    warmup: int = 20
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    special_markers: bool = True
    seed: int = 0
    log_every: int = 10
    max_len: int = 1536
    top_layers: float = 0.5
    """The fraction of decoder layers, counted from the top, that get LoRA; the layers below stay
    frozen and backpropagation stops above them (0.5 makes a CPU step about a third cheaper). The
    new marker tokens then learn only as outputs: tied rows from the output side, untied input rows
    keep their initialisation (the mean of the text they replace)."""

    answer_weight: float = 1.0
    """The weight in the loss of each answer token and the end of sequence (what the model writes
    after its last evidence block, or after the prompt when it does not search; > 0), against 1 for
    markers and queries. A multi-hop trace labels some 30 tokens, and the one that decides a
    comparison or a yes/no question is among the last few: above 1, the verdict counts for more
    than its share."""

    def __post_init__(self):
        if self.answer_weight <= 0:
            raise ValueError(f"answer_weight must be > 0, got {self.answer_weight}")

    def first_lora_layer(self, n_layers: int) -> int:
        if not 0.0 < self.top_layers <= 1.0:
            raise ValueError(f"top_layers must be in (0, 1], got {self.top_layers}")
        return n_layers - max(1, round(n_layers * self.top_layers))


@dataclass(slots=True)
class TrainResult:
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    added_tokens: list[str] = field(default_factory=list)
    trainable_params: int = 0


def load_base(name: str):
    """(model, tokenizer) to train: the bare model in fp32 with plain, trainable linears, on the
    GPU when there is one - never with the marker adapter ``model.adapter: auto`` would merge for an
    embedded model, which would train a new adapter on top of the shipped one while it is later
    applied to the bare model. Needs torch and transformers only (no config schema)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.loader import resolve_device, resolve_source

    source, extra = resolve_source(name)
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **extra)
    return model.to(resolve_device()).eval(), tokenizer


def add_marker_tokens(model, tokenizer, spec: MarkerSpec) -> list[int]:
    """Make the special-token style's delimiters single tokens; their new embedding rows start at
    the mean of the rows of the text they replace. Returns the new ids."""
    if spec.style != "special_token":
        raise ValueError("only the special_token marker style has delimiters to add as tokens")
    texts = [spec.start[0], spec.end[0]]
    inits = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    added = tokenizer.add_tokens(texts, special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(texts)
    if added:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        rows = [model.get_input_embeddings().weight]
        out = model.get_output_embeddings()
        if out is not None and out.weight is not rows[0]:  # untied output rows start the same way
            rows.append(out.weight)
        with torch.no_grad():
            for weight in rows:
                for i, old in zip(ids, inits):
                    weight[i] = weight[old].mean(0)
    return ids


def collate(batch: list[dict], pad_id: int, max_len: int, answer_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, and labels that are -100 wherever mask is 0 or padding;
    with ``answer_weight`` != 1, also per-token loss ``weights`` (``answer_start``)."""
    n = min(max_len, max(len(t["input_ids"]) for t in batch))
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(batch), n), dtype=torch.long)
    weights = torch.ones((len(batch), n)) if answer_weight != 1.0 else None
    for i, t in enumerate(batch):
        x = torch.tensor(t["input_ids"][:n])
        m = torch.tensor(t["mask"][:n], dtype=torch.bool)
        ids[i, : len(x)] = x
        attn[i, : len(x)] = 1
        labels[i, : len(x)] = torch.where(m, x, torch.full_like(x, IGNORE))
        if weights is not None:
            weights[i, answer_start(t["mask"]) :] = answer_weight
    out = {"input_ids": ids, "attention_mask": attn, "labels": labels}
    return out if weights is None else {**out, "weights": weights}


def answer_start(mask: list[int]) -> int:
    """Where a trace's answer begins: after its last unlabelled token (the end of the last
    evidence block, or of the prompt)."""
    return max((k for k, v in enumerate(mask) if not v), default=-1) + 1


def masked_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over the labelled positions only."""
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    return torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                             shift_labels.reshape(-1), ignore_index=IGNORE)


def kept_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions predict a kept label (a mask over ``[:, :-1]``) and those labels, in order."""
    shifted = labels[:, 1:]
    keep = shifted != IGNORE
    return keep, shifted[keep]


def forward_loss(model, batch: dict[str, torch.Tensor], total: float | None = None) -> torch.Tensor:
    """``masked_loss`` of the model on ``batch`` (weighted by ``batch["weights"]`` where given),
    with the output projection applied only where a label is kept: a trace's labelled tokens are a
    few dozen of its hundreds, and the projection onto the vocabulary is a fifth of a small model's
    forward pass. With ``total`` (``loss_weight`` of the whole batch this is a part of), the sum
    divided by it: the parts' losses add up to the whole batch's."""
    causal_lm = _causal_lm(model)
    hidden = causal_lm.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    keep, targets = kept_targets(batch["labels"])
    logits = causal_lm.get_output_embeddings()(hidden[:, :-1][keep])
    losses = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
    if "weights" in batch:
        losses = losses * batch["weights"][:, 1:][keep]
    return losses.sum() / (loss_weight(batch) if total is None else total)


def loss_weight(batch: dict[str, torch.Tensor]) -> float:
    """What ``forward_loss`` divides by: the labelled tokens' weights summed."""
    keep = batch["labels"][:, 1:] != IGNORE
    return float(batch["weights"][:, 1:][keep].sum()) if "weights" in batch else float(keep.sum())


def micro_batches(batch: dict[str, torch.Tensor], max_tokens: int | None) -> list[dict[str, torch.Tensor]]:
    """``batch`` split into runs of rows of at most ``max_tokens`` (rows x padded length; at least
    one row each), each cut to its own longest row: a batch of long traces fits in memory while the
    step's gradient stays the whole batch's."""
    rows, width = batch["input_ids"].shape
    if not max_tokens or rows * width <= max_tokens:
        return [batch]
    per = max(1, max_tokens // width)
    parts = []
    for i in range(0, rows, per):
        part = {k: v[i : i + per] for k, v in batch.items()}
        n = int(part["attention_mask"].sum(1).max())
        parts.append({k: v[:, :n] for k, v in part.items()})
    return parts


def wrap_lora(model, cfg: TrainConfig, token_ids: list[int] | None = None):
    from ..models.quiet import quiet_peft

    tokens = None
    if token_ids:  # the new rows train; an untied output matrix needs its rows trained too
        tokens = {"embed_tokens": token_ids}
        if not getattr(model.config, "tie_word_embeddings", False):
            tokens["lm_head"] = token_ids
    n_layers = model.config.num_hidden_layers
    first = cfg.first_lora_layer(n_layers)
    with quiet_peft():
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, task_type="CAUSAL_LM",
                          target_modules=list(cfg.target_modules), trainable_token_indices=tokens,
                          layers_to_transform=list(range(first, n_layers)) if first else None)
        return get_peft_model(model, lora)


def _causal_lm(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _decoder_layers(model):
    return _causal_lm(model).get_decoder().layers


def freeze_below(model, cfg: TrainConfig) -> None:
    """Freeze every weight below the first layer ``cfg`` trains, for good: an adapter resumed from
    a run over more layers (``--resume`` of an every-layer adapter with ``--top-layers 0.5``)
    continues on the top layers only, and the frozen ones leave the optimiser, the checkpoints and
    the count of trainable parameters (no gradient could reach them anyway)."""
    layers = _decoder_layers(model)
    for layer in layers[: cfg.first_lora_layer(len(layers))]:
        layer.requires_grad_(False)


def stop_backprop_below(model, cfg: TrainConfig):
    """A hook that detaches the input of the first trained layer (None when every layer trains)."""
    layers = _decoder_layers(model)
    first = cfg.first_lora_layer(len(layers))
    if first == 0:
        return None

    def detach(_module, args, kwargs):
        if args:
            return (args[0].detach(), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach()}

    return layers[first].register_forward_pre_hook(detach, with_kwargs=True)


def lr_factor(cfg: TrainConfig):
    """The learning rate's factor at step ``s``: a linear warmup ramp times a cosine from step 0."""
    return lambda s: min(1.0, (s + 1) / max(1, cfg.warmup)) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / max(1, cfg.steps))))


def length_batches(traces: list[dict], batch_size: int, min_rows: int = 1) -> list[list[int]]:
    """Trace indices in groups of ``batch_size`` neighbours in length (less padding); a last group
    of fewer than ``min_rows`` traces joins the one before (under DDP every process needs a row)."""
    order = sorted(range(len(traces)), key=lambda i: len(traces[i]["input_ids"]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if len(batches) > 1 and len(batches[-1]) < min_rows:
        batches[-2].extend(batches.pop())
    return batches


def next_batch(batches: list[list[int]], queue: list, rng: random.Random) -> list[int]:
    """The next batch of the seeded order: every pass over the data a fresh permutation of
    ``batches`` (drawn from ``rng`` into ``queue``), taken from its end."""
    if not queue:
        queue.extend(rng.sample(batches, len(batches)))
    return queue.pop()


def train(model, traces: list[dict], pad_id: int, cfg: TrainConfig, progress=None,
          checkpoint: Path | None = None, checkpoint_every: int = 25,
          max_batch_tokens: int | None = None) -> TrainResult:
    """Train ``model`` (already wrapped by ``wrap_lora``) in place; returns the loss history.
    Batches group traces of similar length (less padding), in a seeded order. ``progress(step,
    loss, eta_s)`` is called every ``log_every`` steps.

    With ``checkpoint`` (a folder), the run saves its whole state there every
    ``checkpoint_every`` steps (trainable weights, optimiser, schedule, batch order, losses) and,
    started again with the same folder, continues from the last one: a run stopped at any point
    loses at most ``checkpoint_every`` steps, and its result equals an uninterrupted run's.

    ``max_batch_tokens`` splits a batch whose rows x length exceed it into parts whose gradients
    add up to the batch's (``micro_batches``): memory, not the result, so it may change between a
    run and its continuation."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    freeze_below(model, cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg))
    batches, rng = length_batches(traces, cfg.batch_size), random.Random(cfg.seed)
    result = TrainResult(trainable_params=sum(p.numel() for p in params))
    queue, running, start, before = [], [], 0, 0.0
    identity = {"config": asdict(cfg), "traces": len(traces), "first": traces[0]["input_ids"][:32]}
    state_file = checkpoint / "state.pt" if checkpoint is not None else None
    if state_file is not None and state_file.exists():
        state = torch.load(state_file, weights_only=False)
        if state["identity"] != identity:
            raise ValueError(f"{state_file} is a checkpoint of another run (other data or settings): "
                             "delete it to start afresh, or resume with the same arguments")
        with torch.no_grad():
            for n, p in named:
                p.copy_(state["params"][n])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        queue, result.losses, running = state["queue"], state["losses"], state["running"]
        start, before = state["step"], state["seconds"]
    model.train()
    stop = stop_backprop_below(model, cfg)
    t0 = time.perf_counter()
    try:
        for step in range(start, cfg.steps):
            picked = [traces[i] for i in next_batch(batches, queue, rng)]
            batch = {k: v.to(device) for k, v in collate(picked, pad_id, cfg.max_len, cfg.answer_weight).items()}
            opt.zero_grad(set_to_none=True)
            total, loss = loss_weight(batch), 0.0
            for part in micro_batches(batch, max_batch_tokens):
                part_loss = forward_loss(model, part, total)
                part_loss.backward()
                loss += part_loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            running.append(loss)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                result.losses.append(sum(running) / len(running))
                running = []
                if progress:
                    rate = (time.perf_counter() - t0) / (step + 1 - start)
                    progress(step + 1, result.losses[-1], rate * (cfg.steps - step - 1))
            if state_file is not None and (step + 1) % checkpoint_every == 0 and step + 1 < cfg.steps:
                save_state(state_file, {"identity": identity, "params": {n: p.detach().clone() for n, p in named},
                                        "optimizer": opt.state_dict(), "schedule": sched.state_dict(),
                                        "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "queue": queue,
                                        "losses": list(result.losses), "running": list(running), "step": step + 1,
                                        "seconds": before + time.perf_counter() - t0})
    finally:
        model.eval()
        if stop is not None:
            stop.remove()
    result.seconds = before + time.perf_counter() - t0
    return result


def save_state(path: Path, state: dict) -> None:
    """Written whole or not at all: a run killed mid-write keeps its previous checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def save(model, tokenizer, out: Path, cfg: TrainConfig, result: TrainResult, card: dict) -> None:
    """Adapter, tokenizer (with any added tokens), training record and a model card."""
    out.mkdir(parents=True, exist_ok=True)
    # the marker rows' trained values are the adapter's own (trainable_tokens_delta replaces the
    # rows); the resized base embedding matrix need not be saved with it
    model.save_pretrained(out, save_embedding_layers=False)
    tokenizer.save_pretrained(out)
    record = {"config": asdict(cfg), "result": asdict(result), **card}
    (out / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
