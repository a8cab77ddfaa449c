"""One-card benchmark: a Qwen2.5-32B-shaped model in nf4 under a 24 GB cap, with an index beside it.

The model is built from its config alone (random weights: nothing is downloaded): the architecture
is created on the meta device and each decoder layer is then given random bf16 weights on the card
and quantised to nf4 (bitsandbytes ``Linear4bit``, the settings of ``models.loader.nf4_config``)
before the next layer's weights exist (``random_qwen.py``), so the 64 GB of full-precision weights
never exist at once. Embeddings and the LM head stay in bf16. The process's PyTorch allocator is capped at 24 GiB (``torch.cuda.set_per_process_memory_fraction``), and a 1M x
384 embedding index stays resident on the card while the model runs. Measured:

1. decode tokens/s at batch 1 and 8 (``HFModelRunner`` steps after a prefill, greedy sampling);
2. evidence prefill tokens/s: the retrieve marker's last token plus a 256-token evidence block fed
   into a row's cache in one step;
3. per-hop cost at 2k and 8k context: that splice vs a re-prefill of context + evidence from
   scratch (what string-based RIG systems do), in ms, and their ratio; and the KV buffers the
   row holds then (spare columns included) beside its tokens' own KV;
4. the zero-prefill splice of the same hop: the block's KV assembled from a warm ``ChunkKVStore``
   (``block_kv``) and copied in with ``step(staged=...)``, its tail recomputed, or the tokens
   CacheBlend would choose (``reselect=``, ``engine.zero_prefill.select: deviation``); for every
   kind of hop, the device syncs torch reports during one (CUDA only: where the host waits for the
   GPU); the tail hop again with the pieces held in the store's host tier (``host_bytes``: pinned
   memory, copied to the card on each hop); and on a miss (a cold store), the block's pieces
   computed one forward each vs together in one packed forward;
5. ``HFModelRunner.evict`` of a 256-token span in the middle of an 8k row;
6. search: top-10 for 8 queries over 1M normalized 384-d vectors (FAISS on the GPU when the
   installed faiss has GPU support, else a matmul + ``torch.topk`` on the device);
7. reranking 20 passages with flashrank, when its model is already on disk (never downloaded);
8. memory: peak allocated, weights, KV bytes per token, the planner's KV budget for the cap minus
   the index (``rig plan``), whether that budget could be allocated beside the weights and the
   index, whether every section ran under the cap, and what the card holds outside torch's
   allocator (the CUDA context, kernel images, FAISS): with torch's peak reserved memory, what a
   24 GiB card would have to hold. Before each section torch's allocator is capped at the cap
   minus what the card then holds outside it, so the whole card stays under the cap.

A re-prefill keeps its cache (as a real one would, to decode on). Rows are prefilled without the
runner's shared-prefix cache, which would hold a lone prompt's KV twice, and the runner's KV
buffers are bounded by the planned KV budget, as the engine bounds them.

Timed regions are synchronised on CUDA; each figure is the median of a few repeats after one
warm-up. Progress goes to stderr; stdout gets a table, then ONE JSON line last. Stopped by SIGTERM
(``timeout``), it still prints them, with the sections that ran (``"complete": false``).

On a GPU box (needs bitsandbytes with CUDA, optionally faiss-gpu; sized to finish well within 8
minutes on an H200)::

    python bench/gpu.py

On CPU (the default without CUDA, or ``--small`` on a GPU) the same code paths run at small shapes
(a 3-layer Qwen2, contexts 256/512, 10k vectors, no nf4 unless ``--quant nf4``) in seconds::

    python bench/gpu.py --device cpu
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rig_decode.config import RerankerConfig
from rig_decode.engine import EngineOptions, HFModelRunner
from rig_decode.engine.kv import GiB, kv_bytes_per_token_of, plan_memory
from rig_decode.kernels import backend_for
from rig_decode.kernels.chunk_kv import ChunkKVStore
from rig_decode.models.loader import ModelLoadError, nf4_config
from rig_decode.retrieval.base import Hit

from harness import Table, emit  # bench/ is on sys.path when run as a script
from random_qwen import build_model, qwen2_config, weights_bytes
from timing import Clock, device_syncs, forward_alone, pick_device

SEED = 0
EMBED_DIM = 384
QUERIES, TOP_K = 8, 10
PASSAGES = 20
SECTIONS = ("model", "index", "decode", "evidence prefill", "hop", "zero-prefill", "evict", "search", "rerank",
            "memory")


@dataclass(frozen=True)
class Shapes:
    name: str
    config: dict
    contexts: tuple[int, int]
    decode_context: int
    decode_steps: int
    evidence: int
    index_rows: int
    cap_bytes: int
    repeats: int
    plan_model: str | None  # a known architecture for the planner; None: plan from the config


LARGE = Shapes(
    name="qwen2.5-32b-nf4",
    config=dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128, vocab_size=152064, max_position_embeddings=32768),
    contexts=(2048, 8192), decode_context=1024, decode_steps=16, evidence=256,
    index_rows=1_000_000, cap_bytes=24 * GiB, repeats=5, plan_model="qwen2.5-32b",
)
SMALL = Shapes(
    name="small",
    # three layers: CacheBlend's probe forward is stopped at layer 2, as on the 64-layer model
    config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=4096),
    contexts=(256, 512), decode_context=64, decode_steps=8, evidence=256,
    index_rows=10_000, cap_bytes=2 * GiB, repeats=3, plan_model=None,
)


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


# -- the measurements ------------------------------------------------------------------------------

def random_ids(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def evidence_segments(n: int) -> tuple[list[int], list[list[int]]]:
    """Piece lengths of an ``n``-token block and their leads, as ``EvidenceFormatter`` lays a block
    out (``EvidenceBlock.segments``, ``.leads``): a head, four documents (a 3-token number, then
    the text, computed after a 3-token lead), a tail."""
    head = tail = n // 16
    doc, rest = divmod(n - head - tail, 4)
    lead = [11, 12, 13]
    return [head, *[3, doc - 3] * 4, tail + rest], [[], *[[], lead] * 4, []]


def prefill(model, prompts: list[list[int]], kv_budget: int | None) -> tuple[HFModelRunner, torch.Tensor]:
    """A runner holding these prompts, and the logits after each; its KV buffers bounded by the
    planned budget, as the engine bounds them. Without prefix sharing: for a lone prompt the
    runner would also keep the prompt's KV as a reusable prefix, a second copy the planned KV
    budget does not count."""
    runner = HFModelRunner(model, pad_id=0, max_slots=kv_budget)
    runner.reset(0)
    return runner, runner.step(runner.add_rows(prompts, share_prefix=False))


class Bench:
    def __init__(self, shapes: Shapes, device: torch.device, dtype: torch.dtype, quant, report: Report):
        self.shapes, self.device, self.dtype, self.quant, self.report = shapes, device, dtype, quant, report
        self.clock = Clock(device)
        self.gen = torch.Generator().manual_seed(SEED)
        self.model = None
        self.index: torch.Tensor | None = None
        self.faiss_index = self._faiss_resources = None
        self.index_bytes = 0  # the index's vectors on the device
        self.index_outside_torch = 0  # what FAISS allocates itself (torch's cap is lowered by as much)
        self.oom = False
        self._planned = None  # the planner's figures, once the index is in place

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def build(self) -> None:
        def make():  # timed to the end of its queued init and quantise kernels
            self.model = build_model(self.shapes.config, self.device, self.dtype, self.quant, seed=SEED)

        r = self.report
        r.add("model", "build (meta + per-layer init)", self.clock.ms(make) / 1e3, "s", "build_s")
        r.add("model", "weights", weights_bytes(self.model) / GiB, "GiB", "weights_gb")

    def build_index(self) -> None:
        """Random unit vectors, built in slices so the fp32 draft never holds the whole matrix."""
        rows, dtype = self.shapes.index_rows, torch.float16 if self.device.type == "cuda" else torch.float32
        gen = torch.Generator(device=self.device).manual_seed(SEED + 1)
        index = torch.empty(rows, EMBED_DIM, device=self.device, dtype=dtype)
        for start in range(0, rows, 100_000):
            end = min(rows, start + 100_000)
            block = torch.randn(end - start, EMBED_DIM, device=self.device, generator=gen)
            index[start:end] = nn.functional.normalize(block, dim=1).to(dtype)
        self.index, self.index_bytes = index, index.nbytes
        self.faiss_index = self._faiss_gpu(index)
        if self.faiss_index is not None:
            self.index = None  # FAISS holds its own copy, outside torch's allocator
        self.report.add("index", f"{rows:,} x {EMBED_DIM} resident", self.index_bytes / GiB,
                        f"GiB ({str(dtype).removeprefix('torch.')})", "index_gb")

    def _faiss_gpu(self, index: torch.Tensor):
        if self.device.type != "cuda":
            return None
        try:
            import faiss
        except ImportError:
            return None
        if not hasattr(faiss, "GpuIndexFlatIP") or faiss.get_num_gpus() < 1:
            return None
        res = faiss.StandardGpuResources()
        res.setTempMemory(256 << 20)  # its default scratch (1.5 GiB) would sit outside the cap
        cfg = faiss.GpuIndexFlatConfig()
        cfg.useFloat16, cfg.device = True, self.device.index or 0
        flat = faiss.GpuIndexFlatIP(res, EMBED_DIM, cfg)
        for start in range(0, index.shape[0], 100_000):
            flat.add(index[start : start + 100_000].float().cpu().numpy())
        self._faiss_resources = res  # the index needs its resources alive
        self.index_outside_torch = index.nbytes + (256 << 20)  # torch's cap is lowered by it from the next section
        return flat

    def decode(self) -> None:
        for batch in (1, 8):
            prompts = [random_ids(self.gen, self.vocab, self.shapes.decode_context) for _ in range(batch)]
            runner, logits = prefill(self.model, prompts, self.kv_budget)
            state = {"logits": logits}

            def step():
                state["logits"] = runner.step([[t] for t in state["logits"].argmax(-1).tolist()])

            ms = self.clock.median_ms(step, self.shapes.decode_steps)
            self.report.add("decode", f"batch {batch} ({self.shapes.decode_context} ctx)", batch * 1e3 / ms,
                            "tokens/s", "decode_tok_s", batch)
            del runner, state

    def hop(self, context: int) -> None:
        """One retrieve hop at ``context``: exact splice, zero-prefill splice, re-prefill."""
        r = self.report
        ctx = random_ids(self.gen, self.vocab, context)
        new = random_ids(self.gen, self.vocab, 1 + self.shapes.evidence)  # the marker's last token, the evidence
        runner, _ = prefill(self.model, [ctx], self.kv_budget)
        splice_once = lambda: runner.step([new])  # noqa: E731
        undo = lambda: runner.drop_last(len(new))  # noqa: E731  (every repeat splices into the same context)
        splice = self.clock.median_ms(splice_once, self.shapes.repeats, reset=undo)
        r.add("evidence prefill", f"{len(new)} tokens, {context} ctx", len(new) * 1e3 / splice, "tokens/s",
              "evidence_prefill_tok_s", context)
        r.add("hop", f"splice, {context} ctx", splice, "ms", "splice_ms", context)
        self.syncs("hop", splice_once, undo, "splice_syncs", context)
        slots, tokens = runner.reserved_slots, len(ctx) + len(new)
        r.add("hop", f"KV held, {context} ctx", slots, f"token slots for {tokens:,} tokens "
              f"({slots * kv_bytes_per_token_of(self.model) / GiB:.2f} GiB)", "kv_held_slots", context)
        self.zero_prefill(runner, new, context, undo)
        del runner  # the re-prefill builds its own cache: do not hold two under the cap
        full = torch.tensor([ctx + new], device=self.device)
        again = self.clock.median_ms(lambda: forward_alone(self.model, full), max(1, self.shapes.repeats // 2))
        r.add("hop", f"re-prefill, {context} ctx", again, "ms", "reprefill_ms", context)
        r.add("hop", f"re-prefill / splice, {context} ctx", again / splice, "x", "reprefill_over_splice", context)

    def zero_prefill(self, runner: HFModelRunner, new: list[int], context: int, undo) -> None:
        """The same hop from a warm ``ChunkKVStore`` (the block's pieces were computed before), with
        the engine's share recomputed: the block's tail, then CacheBlend's choice of tokens
        (``select: deviation``: a two-layer probe, the chosen tokens recomputed in place), and the
        tail with the pieces in the store's host tier (copied to the device on each hop)."""
        block = new[1:]
        n = len(block)
        recompute = max(1, math.ceil(EngineOptions().zero_prefill_recompute * n))  # as the engine counts
        segments, leads = evidence_segments(n)
        warm = ChunkKVStore(self.model)
        on_host = ChunkKVStore(self.model, max_bytes=0, host_bytes=2 * n * kv_bytes_per_token_of(self.model))
        for label, key, store, count, reselect in (
                ("splice", "zero_prefill", warm, n - recompute, 0),
                ("splice, pieces from the host tier", "zero_prefill_host", on_host, n - recompute, 0),
                ("deviation splice", "zero_prefill_deviation", warm, n - 1, recompute - 1)):
            store.block_kv(block, segments, count, leads)

            def hop(store=store, count=count, reselect=reselect):
                kv, shifts = store.block_kv(block, segments, count, leads)
                runner.step([new], staged={0: (kv, shifts)}, reselect={0: reselect})

            metric = f"{label}, {context} ctx"
            try:
                ms = self.clock.median_ms(hop, self.shapes.repeats, reset=undo)
            except Exception as e:  # noqa: BLE001 - reported; the hop's re-prefill rows still follow
                self.report.missing("zero-prefill", metric, f"{key}_ms", self.failure(e), context)
                return
            self.report.add("zero-prefill", metric, ms, f"ms ({n - recompute} of {n} tokens reused)", f"{key}_ms",
                            context)
            self.syncs("zero-prefill", hop, undo, f"{key}_syncs", context, label)

    def cold_pieces(self) -> None:
        """Zero-prefill on a miss: an evidence block's pieces computed from an empty store, one
        forward per piece (``get``) vs all of them in one packed forward (``block_kv``, what a hop
        does), side by side."""
        n = self.shapes.evidence
        block, (segments, leads) = random_ids(self.gen, self.vocab, n), evidence_segments(n)

        def each():
            store = ChunkKVStore(self.model)
            for lead, ids in store.pieces(block, segments, n, leads):
                store.get(ids, lead)

        def packed():
            ChunkKVStore(self.model).block_kv(block, segments, n, leads)

        what = f"ms ({len(segments)} pieces, {n} tokens)"
        one = self.clock.median_ms(each, self.shapes.repeats)
        together = self.clock.median_ms(packed, self.shapes.repeats)
        self.report.add("zero-prefill", "cold pieces, one forward each", one, what, "cold_pieces_each_ms")
        self.report.add("zero-prefill", "cold pieces, one packed forward", together, what, "cold_pieces_packed_ms")

    def syncs(self, section: str, hop, undo, key: str, context: int, label: str = "splice") -> None:
        """The device syncs in one hop: where its host side waits for the GPU (a hop has to read its
        logits in the end; before that, each one stalls the queue)."""
        metric = f"device syncs in one {label}, {context} ctx"
        if self.device.type != "cuda":
            self.report.missing(section, metric, key, "counted on cuda only", context)
            return
        self.report.add(section, metric, device_syncs(hop), "syncs", key, context)
        undo()

    def evict(self) -> None:
        """Drop a block-sized span from the middle of a row: every key after it is re-rotated."""
        context, span = self.shapes.contexts[-1], self.shapes.evidence
        start = (context - span) // 2
        ids = random_ids(self.gen, self.vocab, context)
        state = {"runner": prefill(self.model, [ids], self.kv_budget)[0]}

        def refill():  # each eviction starts from a fresh prefill of the same row
            state["runner"] = None  # free the old cache before the new one is built
            state["runner"] = prefill(self.model, [ids], self.kv_budget)[0]

        ms = self.clock.median_ms(lambda: state["runner"].evict(0, start, start + span), self.shapes.repeats,
                                  reset=refill)
        del state
        self.report.add("evict", f"{span} tokens at {start} of {context}", ms,
                        f"ms ({backend_for(self.device)} rope_shift_)", "evict_ms")

    def search(self) -> None:
        gen = torch.Generator(device=self.device).manual_seed(SEED + 2)
        queries = nn.functional.normalize(torch.randn(QUERIES, EMBED_DIM, device=self.device, generator=gen), dim=1)
        if self.faiss_index is not None:
            host = queries.cpu().numpy()
            fn, backend = (lambda: self.faiss_index.search(host, TOP_K)), "faiss-gpu flat IP"
        else:
            q = queries.to(self.index.dtype)
            fn, backend = (lambda: torch.topk(q @ self.index.T, TOP_K, dim=1)), "matmul + torch.topk"
        ms = self.clock.median_ms(fn, max(10, self.shapes.repeats))
        self.report.add("search", f"top-{TOP_K} of {self.shapes.index_rows:,}, {QUERIES} queries", ms,
                        f"ms ({backend})", "search_ms")
        self.report.data["search_backend"] = backend

    def rerank(self) -> None:
        metric = f"flashrank, {PASSAGES} passages"
        reranker, reason = load_reranker()
        if reranker is None:
            self.report.missing("rerank", metric, "rerank_ms", reason)
            return
        words = "release gateway error fixed changelog version tls handshake timeout retry".split()
        gen = torch.Generator().manual_seed(SEED + 3)
        hits = [Hit(f"d{i}", " ".join(words[j] for j in torch.randint(0, len(words), (80,), generator=gen).tolist()),
                    1.0 - i / PASSAGES, title=f"doc {i}") for i in range(PASSAGES)]
        ms = self.clock.median_ms(lambda: reranker.rerank("which release fixed error E1234", hits, PASSAGES),
                                  self.shapes.repeats)
        self.report.add("rerank", metric, ms, f"ms ({reranker.name})", "rerank_ms")

    def memory(self) -> None:
        r, shapes = self.report, self.shapes
        per_token = kv_bytes_per_token_of(self.model)
        plan = self.plan()
        r.add("memory", "KV per token", per_token, "bytes", "kv_bytes_per_token")
        r.add("memory", "planned KV budget (cap - index)", plan.max_kv_tokens, "tokens", "planned_max_kv_tokens")
        r.add("memory", "planned weights", plan.weights_bytes / GiB, "GiB", "planned_weights_gb")
        r.add("memory", "cap", shapes.cap_bytes / GiB, "GiB", "cap_gb")
        if self.device.type != "cuda":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            r.add("memory", "peak (process max RSS)", peak / GiB, "GiB", "peak_gb")
            r.missing("memory", "planned KV allocatable now", "planned_kv_fits",
                      "no memory cap on cpu")
            r.missing("memory", "every section ran under the cap", "fits_under_cap", "no memory cap on cpu")
            return
        peak = torch.cuda.max_memory_allocated(self.device)
        r.add("memory", "peak allocated", peak / GiB, "GiB", "peak_gb")
        r.add("memory", "peak reserved", torch.cuda.max_memory_reserved(self.device) / GiB, "GiB", "peak_reserved_gb")
        if self.index_outside_torch:
            r.add("memory", "FAISS index + scratch", self.index_outside_torch / GiB, "GiB (torch's cap lowered by it)",
                  "outside_cap_gb")
        # The cap bounds torch's allocator only: the CUDA context, kernel images and FAISS's own
        # allocations take the card's memory beside it, as they would on a 24 GiB card.
        outside = outside_torch(self.device)
        r.add("memory", "device memory outside torch (context, kernels, FAISS)", outside / GiB, "GiB",
              "outside_torch_gb")
        card = torch.cuda.max_memory_reserved(self.device) + outside
        r.add("memory", "peak reserved + outside torch", card / GiB, "GiB", "peak_card_gb")
        r.add("memory", "that fits the cap", card <= shapes.cap_bytes, "", "peak_card_fits")
        kv_fits = self._try_allocate(plan.max_kv_tokens * per_token)
        r.add("memory", "planned KV allocatable now", kv_fits,
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
            gpu_bytes = self.shapes.cap_bytes - max(self.index_bytes, self.index_outside_torch)
            quant = "none" if self.quant is None else self.quant.bnb_4bit_quant_type
            dtype = str(self.dtype).removeprefix("torch.")
            with tempfile.TemporaryDirectory() as tmp:
                model = self.shapes.plan_model or str(Path(tmp) / "config.json")
                if not self.shapes.plan_model:
                    qwen2_config(self.shapes.config).to_json_file(model)
                self._planned = plan_memory(model, gpu_bytes, quant, dtype, dtype)
        return self._planned

    def failure(self, e: Exception) -> str:
        """What a failed measurement reports: out of memory under the cap (which the memory section
        then notes), or the error, its traceback on stderr."""
        if isinstance(e, torch.cuda.OutOfMemoryError):
            self.oom = True
            return f"out of memory under the cap: {str(e).splitlines()[0]}"
        traceback.print_exc(file=sys.stderr)
        return f"{type(e).__name__}: {e}"

    def _try_allocate(self, nbytes: int) -> bool:
        torch.cuda.empty_cache()
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            return False
        del block
        return True


def load_reranker():
    """(reranker, None), or (None, why not): flashrank must be installed and its model on disk."""
    from rig_decode.models.embedded import cache_dir
    from rig_decode.retrieval.base import RetrievalError
    from rig_decode.retrieval.rerank import FlashRankReranker

    try:
        return FlashRankReranker(RerankerConfig().model, cache_dir() / "rerankers"), None
    except RetrievalError as e:
        return None, str(e)


# -- running it ------------------------------------------------------------------------------------

def resolve(args):
    """(device, shapes, quantisation config or None, compute dtype) for the command line."""
    device = pick_device(args.device)
    shapes = SMALL if args.small or device.type == "cpu" else LARGE
    quant = None
    if args.quant == "nf4" or (args.quant == "auto" and device.type == "cuda"):
        try:
            quant = nf4_config()  # the settings load_model quantises with
        except ModelLoadError as e:
            raise SystemExit(str(e)) from None
    if shapes is LARGE and quant is None:
        raise SystemExit("the 32B shapes fit the 24 GiB cap only in nf4 (drop --quant none, or add --small)")
    dtype = quant.bnb_4bit_compute_dtype if quant else torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, shapes, quant, dtype


def outside_torch(device: torch.device) -> int:
    """Bytes the card holds outside torch's allocator: the CUDA context, kernel images, FAISS."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def cap_memory(device: torch.device, card_bytes: int) -> None:
    """Limit torch's allocator on ``device`` so that it and what the card holds outside it now fit
    ``card_bytes`` (an allocation beyond raises OOM)."""
    if device.type == "cuda":
        cap_bytes = card_bytes - outside_torch(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)


class Stopped(BaseException):
    """SIGTERM arrived: a BaseException, so no section's error handling takes it for its own failure."""


SIGTERM_SEEN = threading.Event()  # also set: an exception raised in a finalizer is printed and dropped


def stop_on_sigterm():
    """Raise ``Stopped`` on SIGTERM from now on; returns the handler it replaced."""
    SIGTERM_SEEN.clear()  # a run started in the same process after a stopped one is not stopped at once

    def stop(signum, frame):
        SIGTERM_SEEN.set()
        raise Stopped()

    return signal.signal(signal.SIGTERM, stop)


def run_sections(bench: Bench) -> None:
    """Each section in turn (name, function, whether it needs the model); a failure is reported in
    its row and the rest still run. On SIGTERM a ``stopped`` row names the sections not finished,
    and ``Stopped`` is raised."""
    t_start = time.perf_counter()
    sections = [("model", bench.build, False), ("index", bench.build_index, False),
                ("decode", bench.decode, True)]
    sections += [(f"hop {c}", lambda c=c: bench.hop(c), True) for c in bench.shapes.contexts]
    sections += [("zero-prefill pieces", bench.cold_pieces, True)]
    sections += [("evict", bench.evict, True), ("search", bench.search, False), ("rerank", bench.rerank, False),
                 ("memory", bench.memory, True)]
    for done, (name, fn, needs_model) in enumerate(sections):
        t0 = time.perf_counter()
        try:
            run_section(bench, name, fn, needs_model)
            if SIGTERM_SEEN.is_set():  # its Stopped was dropped (raised in a finalizer)
                raise Stopped()
            now = time.perf_counter()
            log(f"{name}: {now - t0:.1f} s (total {now - t_start:.1f} s)")
        except Stopped:
            left = ", ".join(n for n, _, _ in sections[done:])
            bench.report.failed("stopped", f"SIGTERM {time.perf_counter() - t_start:.0f} s in; not finished: {left}")
            raise


def run_section(bench: Bench, name: str, fn, needs_model: bool) -> None:
    if needs_model and bench.model is None:
        bench.report.failed(name, "skipped: the model was not built")
        return
    if name == "search" and bench.index is None and bench.faiss_index is None:
        bench.report.failed(name, "skipped: the index was not built")
        return
    cap_memory(bench.device, bench.shapes.cap_bytes)  # less what the card now holds outside torch
    try:
        with torch.no_grad():
            fn()
    except Exception as e:  # noqa: BLE001 - one failed section must not lose the others' figures
        bench.report.failed(name, bench.failure(e))
    gc.collect()  # hand back what the section held before the next one allocates under the cap
    if bench.device.type == "cuda":
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
    device, shapes, quant, dtype = resolve(args)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    quantization = "none" if quant is None else quant.bnb_4bit_quant_type
    torch.manual_seed(SEED)
    if device.type == "cuda":  # each section caps the allocator first (run_section)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    report = Report()
    bench = Bench(shapes, device, dtype, quant, report)
    log(f"{shapes.name} on {device} ({quantization}, {str(dtype).removeprefix('torch.')}), "
        f"cap {shapes.cap_bytes / GiB:.0f} GiB")
    previous = stop_on_sigterm()
    try:
        run_sections(bench)
        complete = True
    except Stopped:
        complete = False
    finally:
        signal.signal(signal.SIGTERM, previous)
    report.print()
    result = {
        "bench": "gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shapes": shapes.name,
        "quantization": quantization,
        "dtype": str(dtype).removeprefix("torch."),
        "contexts": list(shapes.contexts),
        "evidence_tokens": shapes.evidence,
        **report.data,
        "na": report.na,
        "errors": report.errors,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "complete": complete,
    }
    emit(result, digits=4)
    return 1 if report.errors or not complete else 0


if __name__ == "__main__":
    sys.exit(main())
