"""One-card benchmark: a Qwen2.5-32B-shaped model in nf4 under a 24 GB cap, with an index beside it.

A driver over the single-purpose benchmarks, in one process under one memory cap: it builds the
model from its config alone (random weights, nf4 layer by layer: ``random_qwen.py``), puts a 1M x
384 embedding index on the card beside it (``retrieval.py``'s ``DeviceIndex``), then measures each
figure with the function its benchmark runs on its own (``--shapes`` / ``--random-index``):

1. decode tokens/s at batch 1 and 8 (``decode_step.py``);
2. per hop at 2k and 8k context (``splice.py``): the evidence prefill (the marker's last token and a
   256-token block) in tokens/s, that splice vs a re-prefill, the KV the row then holds; the
   zero-prefill splices of the same hop and their device syncs (CUDA); cold pieces, each vs packed;
3. ``HFModelRunner.evict`` of a 256-token span in the middle of an 8k row (``rope_shift.py``);
4. search: top-10 for 8 queries over the index; reranking 20 passages with flashrank when its model
   is already on disk (``retrieval.py``);
5. memory: peak allocated, weights, KV bytes per token, the planner's KV budget for the cap minus
   the index (``rig plan``), whether that budget could be allocated beside the weights and the
   index, whether every section ran under the cap, and what the card holds outside torch's
   allocator (CUDA context, kernel images, FAISS): with torch's peak reserved, what a 24 GiB card
   would have to hold.

Before each section torch's allocator is capped at the cap minus what the card then holds outside
it; the runner's KV buffers are bounded by the planned KV budget, as the engine bounds them. A
section that fails is reported in its row, and the rest still run. Progress goes to stderr; stdout
gets one table, then ONE JSON line last. Stopped by SIGTERM (``timeout``), it still prints them,
with the sections that ran (``"complete": false``).

    python bench/gpu.py               # a GPU box: bitsandbytes with CUDA, optionally faiss-gpu
    python bench/gpu.py --device cpu  # small shapes (3 layers, contexts 256/512, 10k vectors), in seconds
"""

from __future__ import annotations

import argparse
import gc
import resource
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from rig_decode.engine.kv import GiB, kv_bytes_per_token_of, plan_memory
from rig_decode.kernels import backend_for

import decode_step  # bench/ is on sys.path when run as a script
import retrieval
import rope_shift
import splice
from harness import SIGTERM_SEEN, Stopped, Table, emit, stop_on_sigterm
from random_qwen import SHAPES, build_model, qwen2_config, quantisation, weights_bytes
from timing import Clock, cap_memory, outside_torch, pick_device

SEED = 0
SECTIONS = ("model", "index", "decode", "evidence prefill", "hop", "zero-prefill", "evict", "search", "rerank",
            "memory")


@dataclass(frozen=True)
class Sizes:
    """What the run measures at a shape."""

    contexts: tuple[int, int]
    decode_context: int
    decode_steps: int
    evidence: int
    index_rows: int
    cap_bytes: int
    repeats: int
    plan_model: str | None  # a known architecture for the planner; None: plan from the config


SIZES = {
    "qwen2.5-32b": Sizes((2048, 8192), 1024, 16, 256, 1_000_000, 24 * GiB, 5, "qwen2.5-32b"),
    "small": Sizes((256, 512), 64, 8, 256, 10_000, 2 * GiB, 3, None),
}


def log(msg: str) -> None:
    print(f"[bench/gpu] {msg}", file=sys.stderr, flush=True)


class Report:
    """Table rows in order, and the same figures for the JSON line (``None`` + reason when n/a)."""

    def __init__(self):
        self.rows: list[tuple] = []  # (section, metric, value, unit), or (section, metric, note)
        self.data: dict = {}
        self.na: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def add(self, section: str, metric: str, value, unit: str, key: str, sub=None) -> None:
        self.rows.append((section, metric, value, unit))
        self._put(key, sub, value)

    def missing(self, section: str, metric: str, key: str, reason: str, sub=None) -> None:
        short = reason if len(reason) <= 100 else reason[:99] + "…"  # the JSON keeps it whole
        self.rows.append((section, metric, f"n/a ({short})"))
        self._put(key, sub, None)
        self.na[key if sub is None else f"{key}.{sub}"] = reason

    def syncs(self, section: str, label: str, count: int | None, key: str, context: int) -> None:
        """The device syncs in one hop (where its host side waits for the GPU), or n/a off CUDA."""
        metric = f"device syncs in one {label}, {context} ctx"
        if count is None:
            self.missing(section, metric, key, "counted on cuda only", context)
        else:
            self.add(section, metric, count, "syncs", key, context)

    def _put(self, key: str, sub, value) -> None:
        if sub is None:
            self.data[key] = value
        else:
            self.data.setdefault(key, {})[str(sub)] = value

    def failed(self, section: str, error: str) -> None:
        self.rows.append((section, "error", error))
        self.errors[section] = error

    def print(self) -> None:
        """The rows grouped by section, in the order of ``SECTIONS``."""
        def rank(row) -> int:
            return next((i for i, name in enumerate(SECTIONS) if row[0].startswith(name)), len(SECTIONS))

        table = Table(("section", "<"), ("metric", "<"), ("value", _value), ("unit", "<"))
        for row in sorted(self.rows, key=rank):  # stable within a section
            table.add(*row)
        table.print()


def _value(v) -> str:
    """A figure as the table shows it: yes/no, thousands separated, 1 to 3 decimals by magnitude."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)


class Run:
    """The model and the index on one device, and each section's measurement of them."""

    def __init__(self, shapes: str, device: torch.device, quant, dtype: torch.dtype, report: Report):
        self.shapes, self.sizes, self.device, self.quant, self.dtype = shapes, SIZES[shapes], device, quant, dtype
        self.report, self.clock, self.gen = report, Clock(device), torch.Generator().manual_seed(SEED)
        self.model = self.index = self._planned = None
        self.oom = False

    def build(self) -> None:
        def make():  # timed to the end of its queued init and quantise kernels
            self.model = build_model(SHAPES[self.shapes], self.device, self.dtype, self.quant, seed=SEED)

        self.report.add("model", "build (meta + per-layer init)", self.clock.ms(make) / 1e3, "s", "build_s")
        self.report.add("model", "weights", weights_bytes(self.model) / GiB, "GiB", "weights_gb")

    def build_index(self) -> None:
        self.index = retrieval.DeviceIndex(self.sizes.index_rows, self.device)
        self.report.add("index", f"{self.index.rows:,} x {retrieval.EMBED_DIM} resident", self.index.nbytes / GiB,
                        f"GiB ({self.index.dtype})", "index_gb")

    def decode(self) -> None:
        s = self.sizes
        for batch in (1, 8):
            tok_s = decode_step.runner_tok_s(self.model, batch, s.decode_context, s.decode_steps, self.clock, self.gen,
                                             self.kv_budget)
            self.report.add("decode", f"batch {batch} ({s.decode_context} ctx)", tok_s, "tokens/s", "decode_tok_s",
                            batch)

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
            quant = "none" if self.quant is None else self.quant.bnb_4bit_quant_type
            dtype = str(self.dtype).removeprefix("torch.")
            with tempfile.TemporaryDirectory() as tmp:
                model = self.sizes.plan_model or str(Path(tmp) / "config.json")
                if not self.sizes.plan_model:
                    qwen2_config(SHAPES[self.shapes]).to_json_file(model)
                self._planned = plan_memory(model, self.sizes.cap_bytes - index, quant, dtype, dtype)
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
        """(name, function, whether it needs the model), in the order they run."""
        out = [("model", self.build, False), ("index", self.build_index, False), ("decode", self.decode, True)]
        for c in self.sizes.contexts:
            out += [(f"hop {c}", lambda c=c: self.hop(c), True),
                    (f"zero-prefill {c}", lambda c=c: self.zero_prefill(c), True)]
        return out + [("zero-prefill pieces", self.cold_pieces, True), ("evict", self.evict, True),
                      ("search", self.search, False), ("rerank", self.rerank, False), ("memory", self.memory, True)]


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
    ap.add_argument("--quant", choices=("auto", "nf4", "none"), default="auto",
                    help="auto: nf4 on CUDA, none on CPU")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: 1 on CPU, where the small shapes gain nothing from more "
                         "and idle-spinning threads distort timings on a busy machine)")
    args = ap.parse_args(argv)
    device = pick_device(args.device)
    shapes = "small" if args.small or device.type == "cpu" else "qwen2.5-32b"
    quant, dtype = quantisation(args.quant, device)
    if shapes != "small" and quant is None:
        raise SystemExit("the 32B shapes fit the 24 GiB cap only in nf4 (drop --quant none, or add --small)")
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    quantization = "none" if quant is None else quant.bnb_4bit_quant_type
    torch.manual_seed(SEED)
    if device.type == "cuda":  # each section caps the allocator first (run_section)
        torch.cuda.reset_peak_memory_stats(device)
    t0, report = time.perf_counter(), Report()
    run = Run(shapes, device, quant, dtype, report)
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
    report.print()
    emit({"bench": "gpu", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "shapes": shapes, "quantization": quantization, "dtype": str(dtype).removeprefix("torch."),
          "contexts": list(run.sizes.contexts), "evidence_tokens": run.sizes.evidence, **report.data,
          "na": report.na, "errors": report.errors, "elapsed_s": round(time.perf_counter() - t0, 1),
          "complete": complete}, digits=4)
    return 1 if report.errors or not complete else 0


if __name__ == "__main__":
    sys.exit(main())
