"""One-card benchmark: a Qwen2.5-32B-shaped model in 4 bits under a 24 GB cap, with an index beside it.

A driver over the single-purpose benchmarks. First two of them run in processes of their own (each
with its own CUDA context, compile caches and graph pools, capped like the rest), before this
process touches the card:

1. decode tokens/s at batch 1 and 8 beside the bound measured on the card, eager (``hf``) vs the
   compiled step (CUDA graphs; on CPU uncompiled, ``graph``), for int4 and, with bitsandbytes, nf4
   (``decode_step.py --shapes``), greedy tokens compiled vs eager; at 32B widths with 16 of the 64
   layers (``--decode-layers``: compiling 64 takes minutes): their % of the bound is a floor for 64's;
2. a prefill of 8k tokens under the cap, chunked (512 tokens, ``engine.prefill_chunk_tokens``) vs
   in one forward: pass or out of memory, peak memory (``prefill_cap.py``).

Then, in one process under one memory cap, it builds the model from its config alone (random
weights, quantised layer by layer: ``random_qwen.py``), puts a 1M x 384 embedding index on the card
beside it (``retrieval.py``'s ``DeviceIndex``), and measures each figure with the function its
benchmark runs on its own (``--shapes`` / ``--random-index``):

3. per hop at 2k and 8k context (``splice.py``): the evidence prefill (the marker's last token and a
   256-token block) in tokens/s, that splice vs a re-prefill, the KV the row then holds; the
   zero-prefill splices of the same hop and their device syncs (CUDA); cold pieces, each vs packed;
4. ``HFModelRunner.evict`` of a 256-token span in the middle of an 8k row (``rope_shift.py``);
5. search: top-10 for 8 queries over the index; reranking 20 passages with flashrank when its model
   is already on disk (``retrieval.py``);
6. memory: peak allocated, weights, KV bytes per token, the planner's KV budget for the cap minus
   the index (``rig plan``), whether that budget could be allocated beside the weights and the
   index, whether every section ran under the cap, and what the card holds outside torch's
   allocator (CUDA context, kernel images, FAISS): with torch's peak reserved, what a 24 GiB card
   would have to hold.

Before each section torch's allocator is capped at the cap minus what the card then holds outside
it; the runner's KV buffers are bounded by the planned KV budget, as the engine bounds them. A
section that fails is reported in its row, and the rest still run. Progress goes to stderr; stdout
gets one table, then ONE JSON line last. Stopped by SIGTERM (``timeout``), it still prints them,
with the sections that ran (``"complete": false``).

    python bench/gpu.py --quant int4  # a GPU box (optionally bitsandbytes, faiss-gpu)
    python bench/gpu.py --device cpu  # small shapes (3 layers, contexts 256/512, 10k vectors), in seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from rig_decode.engine.kv import GiB, kv_bytes_per_token_of, plan_memory
from rig_decode.kernels import backend_for

import retrieval  # bench/ is on sys.path when run as a script
import rope_shift
import splice
from gpu_report import Report
from harness import SIGTERM_SEEN, Stopped, emit, stop_on_sigterm
from random_qwen import QUANTS, SHAPES, build_model, has_bitsandbytes, qwen2_config, quantisation, stored_bytes
from timing import Clock, cap_memory, outside_torch, pick_device

SEED = 0
BENCH = Path(__file__).resolve().parent
SOLO = ("decode", "long prefill")  # sections that run a benchmark in a process of its own
SECTIONS = (*SOLO, "model", "index", "evidence prefill", "hop", "zero-prefill", "evict", "search",
            "rerank", "memory")
STEP_KINDS = "--steps-kind"  # decode_step.py's flag for the decode_step choices it compares


@dataclass(frozen=True)
class Sizes:
    """What the run measures at a shape."""

    contexts: tuple[int, int]
    decode_context: int
    decode_steps: int
    decode_layers: int | None  # decoder layers of the decode bench's model; None: all
    prefill: tuple[int, int]  # the long prefill's tokens, and its chunk
    evidence: int
    index_rows: int
    cap_bytes: int
    repeats: int
    plan_model: str | None  # a known architecture for the planner; None: plan from the config
    timeouts_s: tuple[int, int]  # of decode_step.py and prefill_cap.py, each in a process of its own


SIZES = {
    "qwen2.5-32b": Sizes((2048, 8192), 1024, 10, 16, (8192, 512), 256, 1_000_000, 24 * GiB, 3, "qwen2.5-32b",
                         (200, 120)),
    "small": Sizes((256, 512), 64, 8, None, (512, 64), 256, 10_000, 2 * GiB, 3, None, (240, 240)),
}


def log(msg: str) -> None:
    print(f"[bench/gpu] {msg}", file=sys.stderr, flush=True)


class Run:
    """The model and the index on one device, and each section's measurement of them."""

    def __init__(self, shapes: str, device: torch.device, quant: str, dtype: torch.dtype, report: Report,
                 decode_steps: str, decode_layers: int | None):
        self.shapes, self.sizes, self.device, self.quant, self.dtype = shapes, SIZES[shapes], device, quant, dtype
        self.report, self.clock, self.gen = report, Clock(device), torch.Generator().manual_seed(SEED)
        self.decode_steps, self.decode_layers = decode_steps, decode_layers
        self.model = self.index = self._planned = None
        self.oom = False

    def shape_args(self, quant: str, layers: int | None = None) -> list[str]:
        """What a benchmark run on its own is told of the model, the device and the cap."""
        out = ["--shapes", self.shapes, "--device", self.device.type, "--quant", quant,
               "--cap-gib", f"{self.sizes.cap_bytes / GiB:g}"]
        return out + (["--layers", str(layers)] if layers else [])

    def decode_quants(self) -> list[str]:
        """int4 (torch's kernel) and, where bitsandbytes is installed, nf4 on CUDA; the run's format on CPU."""
        if self.device.type != "cuda":
            return [self.quant]
        return ["int4", *(["nf4"] if has_bitsandbytes() else [])]

    def decode_command(self, quant: str) -> list[str]:
        s = self.sizes
        return ["decode_step.py", *self.shape_args(quant, self.decode_layers), STEP_KINDS, self.decode_steps,
                "--batches", "1,8", "--contexts", str(s.decode_context), "--steps", str(s.decode_steps)]

    def prefill_command(self) -> list[str]:
        tokens, chunk = self.sizes.prefill
        return ["prefill_cap.py", *self.shape_args(self.quant), "--context", str(tokens), "--chunks", f"{chunk},none"]

    def decode(self, quant: str) -> None:
        total = SHAPES[self.shapes]["num_hidden_layers"]
        self.report.decode(run_bench(self.decode_command(quant), self.sizes.timeouts_s[0]), quant,
                           self.decode_layers or total, total)

    def long_prefill(self) -> None:
        failed = self.report.long_prefill(run_bench(self.prefill_command(), self.sizes.timeouts_s[1]))
        if failed:  # chunking is what makes it fit: out of memory with it fails the section
            self.oom = True
            raise RuntimeError(failed)

    def build(self) -> None:
        def make():  # timed to the end of its queued init and quantise kernels
            self.model = build_model(SHAPES[self.shapes], self.device, self.dtype, self.quant, seed=SEED)

        self.report.add("model", "build (meta + per-layer init)", self.clock.ms(make) / 1e3, "s", "build_s")
        self.report.add("model", "weights", stored_bytes(self.model) / GiB, "GiB", "weights_gb")

    def build_index(self) -> None:
        self.index = retrieval.DeviceIndex(self.sizes.index_rows, self.device)
        self.report.add("index", f"{self.index.rows:,} x {retrieval.EMBED_DIM} resident", self.index.nbytes / GiB,
                        f"GiB ({self.index.dtype})", "index_gb")

    def hop(self, context: int) -> None:
        r, h = self.report, splice.runner_hop(self.model, context, self.sizes.evidence, self.sizes.repeats,
                                              self.clock, self.gen, self.kv_budget)
        r.add("evidence prefill", f"{h['new_tokens']} tokens, {context} ctx", h["evidence_prefill_tok_s"],
              "tokens/s", "evidence_prefill_tok_s", context)
        r.add("hop", f"splice, {context} ctx", h["splice_ms"], "ms", "splice_ms", context)
        r.syncs("hop", "splice", h["splice_syncs"], "splice_syncs", context)
        r.add("hop", f"KV held, {context} ctx", h["kv_held_slots"], f"token slots for "
              f"{context + h['new_tokens']:,} tokens ({h['kv_held_bytes'] / GiB:.2f} GiB)", "kv_held_slots", context)
        r.add("hop", f"re-prefill, {context} ctx", h["reprefill_ms"], "ms", "reprefill_ms", context)
        r.add("hop", f"re-prefill / splice, {context} ctx", h["reprefill_over_splice"], "x", "reprefill_over_splice",
              context)

    def zero_prefill(self, context: int) -> None:
        n = self.sizes.evidence
        z = splice.zero_prefill_hop(self.model, context, n, self.sizes.repeats, self.clock, self.gen, self.kv_budget)
        for kind, label in splice.ZERO_PREFILL.items():
            self.report.add("zero-prefill", f"{label}, {context} ctx", z[f"{kind}_ms"],
                            f"ms ({z['reused']} of {n} tokens reused)", f"{kind}_ms", context)
            self.report.syncs("zero-prefill", label, z[f"{kind}_syncs"], f"{kind}_syncs", context)

    def cold_pieces(self) -> None:
        n = self.sizes.evidence
        c = splice.cold_pieces(self.model, n, self.sizes.repeats, self.clock, self.gen)
        what = f"ms ({c['pieces']} pieces, {n} tokens)"
        self.report.add("zero-prefill", "cold pieces, one forward each", c["cold_pieces_each_ms"], what,
                        "cold_pieces_each_ms")
        self.report.add("zero-prefill", "cold pieces, one packed forward", c["cold_pieces_packed_ms"], what,
                        "cold_pieces_packed_ms")

    def evict(self) -> None:
        context, span = self.sizes.contexts[-1], self.sizes.evidence
        ms = rope_shift.runner_evict_ms(self.model, context, span, self.sizes.repeats, self.clock, self.gen,
                                        self.kv_budget)
        self.report.add("evict", f"{span} tokens at {(context - span) // 2} of {context}", ms,
                        f"ms ({backend_for(self.device)} rope_shift_)", "evict_ms")

    def search(self) -> None:
        ms = retrieval.search_ms(self.index, max(10, self.sizes.repeats), self.clock)
        self.report.add("search", f"top-{retrieval.TOP_K} of {self.index.rows:,}, {retrieval.QUERIES} queries", ms,
                        f"ms ({self.index.backend})", "search_ms")
        self.report.data["search_backend"] = self.index.backend

    def rerank(self) -> None:
        metric = f"flashrank, {retrieval.PASSAGES} passages"
        reranker, reason = retrieval.load_reranker()
        if reranker is None:
            self.report.missing("rerank", metric, "rerank_ms", reason)
            return
        self.report.add("rerank", metric, retrieval.rerank_ms(reranker, self.sizes.repeats, self.clock),
                        f"ms ({reranker.name})", "rerank_ms")

    def memory(self) -> None:
        r, cap = self.report, self.sizes.cap_bytes
        per_token, plan = kv_bytes_per_token_of(self.model), self.plan()
        r.add("memory", "KV per token", per_token, "bytes", "kv_bytes_per_token")
        r.add("memory", "planned KV budget (cap - index)", plan.max_kv_tokens, "tokens", "planned_max_kv_tokens")
        r.add("memory", "planned weights", plan.weights_bytes / GiB, "GiB", "planned_weights_gb")
        r.add("memory", "cap", cap / GiB, "GiB", "cap_gb")
        if self.device.type != "cuda":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            r.add("memory", "peak (process max RSS)", peak / GiB, "GiB", "peak_gb")
            r.missing("memory", "planned KV allocatable now", "planned_kv_fits", "no memory cap on cpu")
            r.missing("memory", "every section ran under the cap", "fits_under_cap", "no memory cap on cpu")
            return
        r.add("memory", "peak allocated", torch.cuda.max_memory_allocated(self.device) / GiB, "GiB", "peak_gb")
        r.add("memory", "peak reserved", torch.cuda.max_memory_reserved(self.device) / GiB, "GiB", "peak_reserved_gb")
        if self.index is not None and self.index.outside_torch:
            r.add("memory", "FAISS index + scratch", self.index.outside_torch / GiB, "GiB (torch's cap lowered by it)",
                  "outside_cap_gb")
        # The cap bounds torch's allocator only: the CUDA context, kernel images and FAISS's own
        # allocations take the card's memory beside it, as they would on a 24 GiB card.
        outside = outside_torch(self.device)
        r.add("memory", "device memory outside torch (context, kernels, FAISS)", outside / GiB, "GiB",
              "outside_torch_gb")
        card = torch.cuda.max_memory_reserved(self.device) + outside
        r.add("memory", "peak reserved + outside torch", card / GiB, "GiB", "peak_card_gb")
        r.add("memory", "that fits the cap", card <= cap, "", "peak_card_fits")
        r.add("memory", "planned KV allocatable now", self._can_allocate(plan.max_kv_tokens * per_token),
              f"({plan.max_kv_tokens * per_token / GiB:.2f} GiB beside weights + index)", "planned_kv_fits")
        r.add("memory", "every section ran under the cap", not self.oom, "", "fits_under_cap")

    @property
    def kv_budget(self) -> int:
        """The planned KV budget in tokens: what the engine would bound the runner's buffers by."""
        return self.plan().max_kv_tokens

    def plan(self):
        """The planner's figures for the cap minus the index (``rig plan``), computed once (after
        the index section)."""
        if self._planned is None:
            index = max(self.index.nbytes, self.index.outside_torch) if self.index is not None else 0
            dtype = str(self.dtype).removeprefix("torch.")
            with tempfile.TemporaryDirectory() as tmp:
                model = self.sizes.plan_model or str(Path(tmp) / "config.json")
                if not self.sizes.plan_model:
                    qwen2_config(SHAPES[self.shapes]).to_json_file(model)
                self._planned = plan_memory(model, self.sizes.cap_bytes - index, self.quant, dtype, dtype)
        return self._planned

    def failure(self, e: Exception) -> str:
        """What a failed section reports: out of memory under the cap (which the memory section then
        notes), or the error, its traceback on stderr."""
        if isinstance(e, torch.cuda.OutOfMemoryError):
            self.oom = True
            return f"out of memory under the cap: {str(e).splitlines()[0]}"
        traceback.print_exc(file=sys.stderr)
        return f"{type(e).__name__}: {e}"

    def _can_allocate(self, nbytes: int) -> bool:
        torch.cuda.empty_cache()
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            return False
        del block
        return True

    def sections(self) -> list[tuple[str, object, bool]]:
        """(name, function, whether it needs the model) in order: first ``SOLO``, while we hold no memory."""
        out = [(f"decode {q}", lambda q=q: self.decode(q), False) for q in self.decode_quants()]
        out += [("long prefill", self.long_prefill, False), ("model", self.build, False),
                ("index", self.build_index, False)]
        for c in self.sizes.contexts:
            out += [(f"hop {c}", lambda c=c: self.hop(c), True),
                    (f"zero-prefill {c}", lambda c=c: self.zero_prefill(c), True)]
        return out + [("zero-prefill pieces", self.cold_pieces, True), ("evict", self.evict, True),
                      ("search", self.search, False), ("rerank", self.rerank, False), ("memory", self.memory, True)]


def run_bench(command: list[str], timeout_s: float) -> dict:
    """``bench/<script> args...`` in a process of its own (with this one's CPU threads), its progress
    and table on our stderr; the JSON of its last line."""
    log("running " + " ".join(command))
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run([sys.executable, str(BENCH / command[0]), *command[1:]], stdout=subprocess.PIPE,
                          text=True, timeout=timeout_s, env=env)
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), file=sys.stderr, flush=True)
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{command[0]} exited with {proc.returncode}; stderr is in the log above")
    return json.loads(lines[-1])


def run_sections(run: Run) -> None:
    """Each section in turn; a failure is reported in its row and the rest still run. On SIGTERM a
    ``stopped`` row names the sections not finished, and ``Stopped`` is raised."""
    t_start = time.perf_counter()
    sections = run.sections()
    for done, (name, fn, needs_model) in enumerate(sections):
        t0 = time.perf_counter()
        try:
            run_section(run, name, fn, needs_model)
            if SIGTERM_SEEN.is_set():  # its Stopped was dropped (raised in a finalizer)
                raise Stopped()
            now = time.perf_counter()
            log(f"{name}: {now - t0:.1f} s (total {now - t_start:.1f} s)")
        except Stopped:
            left = ", ".join(n for n, _, _ in sections[done:])
            run.report.failed("stopped", f"SIGTERM {time.perf_counter() - t_start:.0f} s in; not finished: {left}")
            raise


def run_section(run: Run, name: str, fn, needs_model: bool) -> None:
    if needs_model and run.model is None:
        run.report.failed(name, "skipped: the model was not built")
        return
    if name == "search" and run.index is None:
        run.report.failed(name, "skipped: the index was not built")
        return
    if not name.startswith(SOLO):  # those cap themselves; this process has not touched the card yet
        cap_memory(run.device, run.sizes.cap_bytes)  # less what the card now holds outside torch
    try:
        with torch.no_grad():
            fn()
    except Exception as e:  # noqa: BLE001 - one failed section must not lose the others' figures
        run.report.failed(name, run.failure(e))
    gc.collect()  # hand back what the section held before the next one allocates under the cap
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--small", action="store_true", help="small shapes on any device")
    ap.add_argument("--quant", choices=QUANTS, default="auto",
                    help="the weights of the model built here (decode compares int4 and nf4 itself); auto: nf4 on "
                         "CUDA with bitsandbytes, else int4 on CUDA, none on CPU")
    ap.add_argument("--decode-steps", help="decode_step choices the decode compares (default: hf,compiled on CUDA, "
                    "hf,graph on CPU, where compiling takes minutes)")
    ap.add_argument("--decode-layers", type=int, help="decoder layers of the decode's model (default: 16 of the 32B "
                    "shapes' 64, all of the small ones'; 0: all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: 1 on CPU, where the small shapes gain nothing from more "
                         "and idle-spinning threads distort timings on a busy machine)")
    args = ap.parse_args(argv)
    device = pick_device(args.device)
    shapes = "small" if args.small or device.type == "cpu" else "qwen2.5-32b"
    quantization, dtype = quantisation(args.quant, device)
    if shapes != "small" and quantization not in ("nf4", "int4"):
        raise SystemExit("the 32B shapes fit the 24 GiB cap only in 4 bits: --quant int4 or nf4 (or add --small)")
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(SEED)
    layers = SIZES[shapes].decode_layers if args.decode_layers is None else args.decode_layers or None
    steps = args.decode_steps or ("hf,compiled" if device.type == "cuda" else "hf,graph")
    t0, report = time.perf_counter(), Report()
    run = Run(shapes, device, quantization, dtype, report, steps, layers)
    log(f"{shapes} on {device} ({quantization}, {str(dtype).removeprefix('torch.')}), "
        f"cap {run.sizes.cap_bytes / GiB:.0f} GiB")
    previous = stop_on_sigterm()
    try:
        run_sections(run)
        complete = True
    except Stopped:
        complete = False
    finally:
        signal.signal(signal.SIGTERM, previous)
    report.print(SECTIONS)
    emit({"bench": "gpu", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "shapes": shapes, "quantization": quantization, "dtype": str(dtype).removeprefix("torch."),
          "decode_steps": steps, "contexts": list(run.sizes.contexts), "evidence_tokens": run.sizes.evidence,
          **report.data,
          "na": report.na, "errors": report.errors, "elapsed_s": round(time.perf_counter() - t0, 1),
          "complete": complete}, digits=4)
    return 1 if report.errors or not complete else 0


if __name__ == "__main__":
    sys.exit(main())
