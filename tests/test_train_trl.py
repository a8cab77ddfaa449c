"""Marker SFT on TRL (``rig_decode/train/trl_sft.py``): the engine's loss mask becomes TRL's labels,
the loss is the hand-written loop's on the same batch, and two processes under ``accelerate launch``
train as one does on the same global batch."""

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

from rig_decode.markers import MarkerSpec  # noqa: E402
from rig_decode.train.lora import (IGNORE, TrainConfig, add_marker_tokens, collate, forward_loss,  # noqa: E402
                                   length_batches, train, wrap_lora)
from rig_decode.train.trl_sft import LoopBatches, sft_trainer, train_trl  # noqa: E402

from .helpers import ROOT, tiny_model, tiny_tokenizer  # noqa: E402


def traces(tok, n: int = 8, seed: int = 0) -> list[dict]:
    """Random traces shaped like the builder's: prompt (mask 0), marker and query (1), evidence (0),
    another marker (1), evidence (0), answer and EOS (1); ragged lengths."""
    start, end = len(tok), len(tok) + 1  # the ids add_marker_tokens gives the two delimiters
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        def words(k):
            return [rng.randrange(3, len(tok)) for _ in range(k)]

        parts = [(words(rng.randrange(10, 20)), 0), ([start, *words(3), end], 1), (words(rng.randrange(5, 12)), 0),
                 ([start, *words(2), end], 1), (words(8), 0), ([*words(rng.randrange(2, 6)), 2], 1)]
        ids = [t for p, _ in parts for t in p]
        mask = [m for p, m in parts for _ in p]
        out.append({"variant": "special", "style": "special_token", "kind": "plain", "system_prompt": "Search.",
                    "input_ids": ids, "mask": mask, "marker_token_ids": [start, end]})
    return out


def _model(tok):
    model = tiny_model(len(tok))
    added = add_marker_tokens(model, tok, MarkerSpec.special_token())
    return wrap_lora(model, TrainConfig(rank=4, alpha=8, top_layers=1.0), added)


def test_trl_labels_are_the_engines_mask_and_its_loss_is_the_loops(tmp_path):
    """Every prompt and evidence token gets label -100 (zero weight), every token the model writes its
    own id; the first step's loss is ``lora.forward_loss`` of the same batch."""
    tok = tiny_tokenizer()
    data = traces(tok)
    model = _model(tok)
    cfg = TrainConfig(steps=1, batch_size=len(data), lr=1e-3, warmup=1, log_every=1, top_layers=1.0)
    with torch.no_grad():
        expected = float(forward_loss(model, collate(data, tok.pad_token_id, cfg.max_len)))
    trainer = sft_trainer(model, tok, data, cfg, tmp_path, progress=False)
    labelled = {tuple(r["input_ids"]): r["labels"] for r in trainer.train_dataset}
    for t in data:
        assert labelled[tuple(t["input_ids"])] == [i if m else IGNORE for i, m in zip(t["input_ids"], t["mask"])]
    result = train_trl(trainer, cfg)
    assert result.losses == [pytest.approx(expected, rel=1e-4)]


def test_one_process_trains_as_the_loop_does_step_for_step(tmp_path):
    """Unpacked, TRL draws the loop's batches in the loop's order and steps the loop's schedule: over
    seven steps that cross two passes over the data (10 traces in batches of 4, 4 and 2), the loop's
    losses step by step and its weights at the end."""
    data = traces(tiny_tokenizer(), 10, seed=3)
    cfg = TrainConfig(steps=7, batch_size=4, lr=3e-3, warmup=3, log_every=1, top_layers=1.0, seed=5)
    tok = tiny_tokenizer()
    loop_model = _model(tok)
    loop = train(loop_model, data, tok.pad_token_id, cfg)
    tok = tiny_tokenizer()
    trainer = sft_trainer(_model(tok), tok, data, cfg, tmp_path, progress=False)
    result = train_trl(trainer, cfg)
    assert len(loop.losses) == 7 and len(set(loop.losses)) == 7
    assert result.losses == pytest.approx(loop.losses, rel=1e-4)
    trained = dict(trainer.model.named_parameters())
    for n, p in loop_model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(trained[n], p, atol=1e-5), n


def test_loop_batches_split_each_global_batch_over_the_processes():
    """Process ``p`` of ``w`` takes every ``w``-th batch from the ``p``-th (accelerate's sharding): part
    ``p`` of each global batch, the parts together the one-process batch; a last length group of fewer
    traces than processes joins the one before."""
    lengths = random.Random(0).sample(range(1, 50), 10)
    data = [{"input_ids": [0] * n} for n in lengths]  # length groups of 4, 4 and 2
    one = list(LoopBatches(data, 4, steps=7, seed=1))
    two = list(LoopBatches(data, 4, steps=7, seed=1, world=2))
    assert len(one) == 7 and len(two) == 14 and all(two)
    assert [two[i] + two[i + 1] for i in range(0, 14, 2)] == one
    first_pass = sorted(one[:3], key=lambda b: min(lengths[i] for i in b))
    assert sorted(i for b in first_pass for i in b) == list(range(10))  # a pass draws every trace once
    assert all(max(lengths[i] for i in a) <= min(lengths[i] for i in b) for a, b in zip(first_pass, first_pass[1:]))
    assert sorted(map(len, length_batches(data[:9], 4))) == [1, 4, 4]
    assert sorted(map(len, length_batches(data[:9], 4, min_rows=2))) == [4, 5]


def _write(tmp_path):
    tok = tiny_tokenizer()
    tiny_model(len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = traces(tok, 16, seed=1)
    with (tmp_path / "traces.jsonl").open("w") as f:
        for t in data:
            f.write(json.dumps(t) + "\n")
    return data


def _run(tmp_path, out: str, launcher: list[str]):
    args = ["--data", str(tmp_path / "traces.jsonl"), "--out", str(tmp_path / out), "--model", str(tmp_path / "model"),
            "--steps", "4", "--batch-size", "8", "--log-every", "1", "--top-layers", "1.0", "--lr", "3e-3", "--warmup", "1",
            "--trainer", "trl"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU, on any machine
    proc = subprocess.run([*launcher, str(ROOT / "scripts" / "train_markers.py"), *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / out / "adapter_model.safetensors").is_file()
    processes = re.findall(r"SFTTrainer on (\d+) process\(es\) of \S+, (\d+) rows each", proc.stderr)
    return json.loads((tmp_path / out / "training.json").read_text())["result"]["losses"], processes


def test_two_processes_train_as_one_on_the_same_global_batch(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` (with no GPU: DDP on the CPU over gloo), 4
    rows each: the same losses, step by step, as one process with batches of 8 (the gradient is the
    whole batch's: tokens are counted across the processes), over two passes of the two batches; a
    batch's loss falls from its first step to its second."""
    data = _write(tmp_path)
    one, single = _run(tmp_path, "one", [sys.executable])
    two, double = _run(tmp_path, "two", [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                                         "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                                         "--dynamo_backend", "no"])
    assert single == [("1", "8")] and double == [("2", "4")] * 2
    assert two == pytest.approx(one, rel=1e-4)
    order = list(LoopBatches(data, 8, steps=4, seed=0))  # the script's seed: 0
    assert len(one) == 4 and sorted(map(sorted, order)) == sorted(map(sorted, order[:2] * 2))
    for step, batch in enumerate(order[:2]):
        again = next(k for k in range(2, 4) if order[k] == batch)
        assert one[again] < one[step]


def test_a_stopped_run_continues_from_its_checkpoint_to_the_same_result(tmp_path):
    """Stopped after its third step (the checkpoint at 2 survives), the same run started again over the
    same folder continues from step 2 and ends with the losses and weights of an uninterrupted run."""
    from transformers import TrainerCallback

    data = traces(tiny_tokenizer(), 16, seed=2)
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup=1, log_every=1, top_layers=1.0)

    def run(out, *callbacks):
        tok = tiny_tokenizer()  # its own: adding the markers changes it
        trainer = sft_trainer(_model(tok), tok, data, cfg, tmp_path / out, checkpoint_every=2, progress=False)
        for c in callbacks:
            trainer.add_callback(c)
        return train_trl(trainer, cfg), trainer.model

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt

    whole, whole_model = run("whole")
    with pytest.raises(KeyboardInterrupt):
        run("cut", Stop())
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoint").glob("checkpoint-*")) == ["checkpoint-2"]
    class Steps(TrainerCallback):
        seen: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append(state.global_step)

    resumed, resumed_model = run("cut", Steps())
    assert Steps.seen == [3, 4, 5, 6]  # from the checkpoint, not from the start
    assert len(whole.losses) == 6 and resumed.losses == pytest.approx(whole.losses, abs=1e-6)
    for (n, a), (_, b) in zip(whole_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
    with pytest.raises(KeyboardInterrupt):
        run("other", Stop())
    cfg = TrainConfig(steps=6, batch_size=4, lr=1e-3, warmup=1, log_every=1, top_layers=1.0)  # another run
    with pytest.raises(ValueError, match="checkpoints of another run"):
        run("other")
