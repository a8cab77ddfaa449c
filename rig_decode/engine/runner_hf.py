"""Batched forward passes over one HuggingFace ``DynamicCache`` with ragged rows.

Every step each row feeds the tokens it has pending: one sampled token when decoding, the
marker-completing token plus a whole evidence block after a hop (a prefill at an offset, never one
token per step), a whole prompt when it has just joined, or nothing while it waits for evidence.

Each row owns its line of cache columns and writes at its own next column (``ends``): a row's
tokens sit in token order (from the left for a row that joined a running batch; a batch's first
prompts sit behind leading holes until a compaction), and the columns after its last token are its
own spare room. The runner keeps a 2-D attention mask over all columns (0 for holes) and passes explicit
per-row ``position_ids`` that count real tokens only, so each row computes exactly what it would
compute alone: that is the splice == re-prefill invariant. While no row has a hole the mask is
dropped and attention takes its plain causal path.

* A step over a cache with holes, or with rows feeding different numbers of tokens, is *packed*:
  every fed token goes in one sequence ``[1, T]`` (decode tokens, evidence blocks and new prompts
  together; a parked row feeds nothing and costs nothing), each token's key and value are written
  in place at its row's next column (``BufferedLayer.scatter``), and a registered attention function
  (``models.packed_attention``) lets each token attend over its own row only: the one-token rows as one
  batch over the whole cache, each longer row over a view of its own cache row, both through the
  model's own attention (sdpa or eager). The weights are read once for the whole step; no row's
  cache is copied, and a row behind the widest one fills its own spare columns.
* A batch's first prompts (an empty cache), or rows feeding the same number of tokens over a cache
  without holes (a lone row, rows in lockstep), go in one plain forward as new right-hand columns.

Keys carry their rotary position already, so attention does not care which column holds a key.
``compact`` moves every row's tokens to the left end, so the cache is as wide as its longest row
(it drops leading holes of first prompts and evicted spans): when a row leaves the batch, and
whenever the columns beyond the longest row's length are a quarter of the columns.

The cache and the row bookkeeping (``attn``, ``lengths``, ``ends``) live in a ``RowCache`` (``row_cache.py``);
its layers are ``models.kv_buffers.BufferedLayer``s: writes land in place, in buffers with spare rows and
columns. Where the KV is written: a computed token's key and value in ``BufferedLayer.update``, called by the
model's attention during a forward the runner runs, at the columns the runner set in ``layer.scatter`` (a
packed step) or as new right-hand columns (a plain one); precomputed KV is copied in by ``RowCache.seed`` (a
shared prompt prefix) and ``KVSurgery`` (staged evidence).

A row can also drop a span of its tokens (``evict``) and take precomputed KV (``step(..., staged=)``,
zero-prefill evidence): both move keys to new positions, done by ``KVSurgery`` (``kv_surgery.py``),
which the runner holds and calls; it never calls back. ``step`` runs its forwards through ``_forward``.

Prompts share their start (the system prompt). The runner keeps the KV of the last prompt prefix it
computed (valid, attention being causal, for any prompt that starts the same way: a new row is seeded
with the longest common prefix and prefills the rest) until the weights change (``reset``).

A decode step (every row feeds one token over a cache that holds tokens) can instead run as one
function of tensors over the layers' whole buffers (``decode_step``: ``models.decode_graph``),
compiled with no graph break and, on CUDA, replayed as a CUDA graph; the runner pads the batch to
the buffers' rows, so its shapes change only when a buffer grows. Every prefill (prompts, evidence,
rows joining, a shared prefix) runs in forwards of at most ``prefill_chunk`` tokens, so its
activations are bounded by the chunk, not by the prompt.

Only full-attention models are served (every cache layer a ``BufferedLayer``): a sliding window would
count hole columns as tokens.
"""

from __future__ import annotations

import torch

from ..models.cache_arg import cache_kw
from ..models.decode_graph import DecodeGraph, decode_step_for
from ..models.kv_buffers import new_cache
from ..models.packed_attention import PACKED_ATTENTION, attention_implementation, packed_plan
from .kv import SHARED_PREFIX_TOKENS
from .kv_surgery import KVSurgery, ProbeDone, stop_after
from .row_cache import RowCache


class HFModelRunner:
    MIN_SHARED_PREFIX = 16

    def __init__(self, model, pad_id: int, max_slots: int | None = None, prefill_chunk: int | None = None,
                 decode_step: str = "hf"):
        """``max_slots``: token slots (rows x columns) the cache's buffers may hold, spare room
        included (the engine's KV budget; ``BufferedLayer`` says how it bounds them); None: no
        bound. ``prefill_chunk``: tokens one forward takes at most; None: no bound. ``decode_step``:
        ``hf`` (the HF modules), ``graph`` or ``compiled`` (``DecodeGraph``), ``auto`` (``decode_step_for``)."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 (or None), got {prefill_chunk}")
        self.model, self.pad_id, self.prefill_chunk = model, pad_id, prefill_chunk
        self.device = next(model.parameters()).device
        self.decode_step = decode_step_for(model, decode_step)
        self.graph = None if self.decode_step == "hf" else DecodeGraph(model, compile=self.decode_step == "compiled")
        self.kv = RowCache(model.config, self.device, max_slots)
        self.surgery = KVSurgery(model, self.kv)
        self._prefix: tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._capture: dict[int, list[int]] = {}  # row -> its prompt, whose KV becomes the cached prefix once fed

    # The row cache's state, read through the runner: read-only names for the RowCache's own (live)
    # objects; only the runner and its KV surgery change them.
    cache = property(lambda self: self.kv.cache)
    attn = property(lambda self: self.kv.attn)
    lengths = property(lambda self: self.kv.lengths)
    ends = property(lambda self: self.kv.ends)
    batch_size = property(lambda self: self.kv.batch_size)
    num_columns = property(lambda self: self.kv.num_columns)
    has_holes = property(lambda self: self.kv.has_holes)
    num_slots = property(lambda self: self.kv.num_slots)
    reserved_slots = property(lambda self: self.kv.reserved_slots)

    @property
    def context_limit(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def reset(self, batch_size: int = 0, weights_changed: bool = False) -> None:
        """An empty batch of ``batch_size`` rows; ``weights_changed``: the cached prompt prefix goes too."""
        self.kv.reset(batch_size)
        self._capture = {}
        if weights_changed:
            self._prefix = None

    # -- adding rows --------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Reset to these prompts and prefill them; fp32 logits ``[B, vocab]`` after each."""
        self.reset(0)
        return self.step(self.add_rows(prompts))

    @torch.no_grad()
    def add_rows(self, prompts: list[list[int]], share_prefix: bool = True) -> list[list[int]]:
        """Append one row per prompt, seeded with the shared prefix where it applies (unless
        ``share_prefix`` is off); returns what each new row still has to feed (the rest of its
        prompt)."""
        if self.kv.cache is None:
            self.reset(0)
        if not share_prefix:
            self.kv.grow(len(prompts), columns=0)
            return [list(p) for p in prompts]
        # Several prompts: the part they all share becomes the cached prefix, computed once (only what
        # the cache does not hold yet). A lone prompt is prefilled in the step, with the other rows;
        # its KV then becomes the cached prefix (``_capture_prefix``), e.g. for the next turn.
        # The cached prefix is a copy beside the rows' KV: at most SHARED_PREFIX_TOKENS (kv.py) of it.
        if len(prompts) > 1:
            shared = common_prefix(prompts)[: min(min(len(p) for p in prompts) - 1, SHARED_PREFIX_TOKENS)]
            if len(shared) >= self.MIN_SHARED_PREFIX and len(shared) > self._cached(shared):
                self._compute_prefix(shared)
        elif len(ids := prompts[0][:SHARED_PREFIX_TOKENS]) >= self.MIN_SHARED_PREFIX and len(ids) > self._cached(ids):
            self._capture[self.batch_size] = list(ids)
        seeds = [min(self._cached(p), len(p) - 1) for p in prompts]  # every row feeds >= 1 token
        seeds = [n if n >= self.MIN_SHARED_PREFIX else 0 for n in seeds]
        first, width = self.batch_size, max(seeds)
        self.kv.grow(len(prompts), columns=max(0, width - self.num_columns),
                     like=self._prefix[1] if self._prefix else None)
        if width:  # a new row starts at the left, like every row
            self.kv.seed(first, seeds, self._prefix[1])
        return [p[n:] for p, n in zip(prompts, seeds)]

    def _cached(self, ids: list[int]) -> int:
        """How many leading tokens of ``ids`` the cached prefix holds."""
        return 0 if self._prefix is None else len(common_prefix([self._prefix[0], ids]))

    def _compute_prefix(self, ids: list[int]) -> None:
        """Cache the KV of ``ids``, extending the cached prefix they share (if any)."""
        known = self._cached(ids)
        one = new_cache(self.model.config)
        if known:
            for layer, (k, v) in zip(one.layers, self._prefix[1]):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k[:, :, :known], v[:, :, :known]
        step = self.prefill_chunk or len(ids)
        for start in range(known, len(ids), step):
            end = min(start + step, len(ids))
            self.model(input_ids=torch.tensor([ids[start:end]], device=self.device),
                       position_ids=torch.arange(start, end, device=self.device)[None],
                       **cache_kw(one), use_cache=True, logits_to_keep=1)
        self._prefix = (list(ids), [(layer.keys, layer.values) for layer in one.layers])

    def _capture_prefix(self) -> None:
        """A lone new row whose prompt is now in the cache (its first columns, in order: it was
        seeded at the left and fed right after) leaves a copy of that KV as the cached prefix. A row
        whose next column equals its real-token count holds no hole before it: read on the host."""
        for row, ids in self._capture.items():
            n = len(ids)
            if self.lengths[row] >= n and self.ends[row] == self.lengths[row]:
                layers = self.cache.layers
                self._prefix = (ids, [(layer.keys[row : row + 1, :, :n].clone(),
                                       layer.values[row : row + 1, :, :n].clone()) for layer in layers])
        self._capture.clear()

    # -- stepping -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, rows: list[list[int]], staged: dict[int, tuple[list, torch.Tensor]] | None = None,
             reselect: dict[int, int] | None = None) -> torch.Tensor:
        """Feed each row its tokens (a row may feed none); fp32 logits ``[B, vocab]`` after each
        row's last token (rows that fed nothing get meaningless logits).

        ``staged``: row -> (per-layer ``(keys, values)`` ``[1, kv_heads, n, head_dim]`` at
        piece-local positions, per-column shift ``[n]``) standing for that row's pending tokens
        ``1 .. n`` (``ChunkKVStore.block_kv``); the row must have at least one token after them.
        ``reselect``: staged row -> how many of its staged tokens to recompute with full attention,
        chosen as CacheBlend does (``KVSurgery.choose_deviating``)."""
        assert self.cache is not None and len(rows) == self.batch_size, "rows must match the batch"
        if staged:
            logits = self._step_staged(rows, staged, reselect or {})
        elif reselect:
            raise ValueError("reselect names staged tokens, but nothing is staged")
        else:
            logits = self._forward(rows)
        if self._capture:  # a joining row's prompt is whole in the cache only now
            self._capture_prefix()
        return logits

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """A forward over the rows' tokens: a decode step through the graph where there is one,
        else as new columns where that is plain, else packed; in chunks of at most
        ``prefill_chunk`` tokens."""
        lens = [len(r) for r in rows]
        if not any(lens):
            raise ValueError("no row has anything to feed")
        if self.prefill_chunk is not None and sum(lens) > self.prefill_chunk:
            return self._forward_chunked(rows)
        if self.graph is not None and not self.kv.is_empty and all(n == 1 for n in lens):
            return self._forward_graph(rows)
        if self.kv.is_empty or (not self.has_holes and len(set(lens)) == 1):
            return self._forward_columns(rows)
        return self._forward_packed(rows)

    def _forward_chunked(self, rows: list[list[int]]) -> torch.Tensor:
        """The rows' tokens in forwards of at most ``prefill_chunk`` tokens, in order: each takes
        the next tokens of the rows, first row first, until the chunk is full. A row's logits come
        from the forward that fed its last token."""
        rest, logits = [list(r) for r in rows], None
        while any(rest):
            budget, part = self.prefill_chunk, []
            # over an empty cache the rows go as one padded [rows, width] forward: bound the width
            width = max(1, self.prefill_chunk // len(rows)) if self.kv.is_empty else budget
            for r in rest:
                take = min(len(r), budget, width)
                part.append(r[:take])
                budget -= take
            out = self._forward(part)
            if logits is None:
                logits = out
            else:  # the rows this forward fed their last tokens
                done = [i for i, (p, r) in enumerate(zip(part, rest)) if p and len(p) == len(r)]
                logits[done] = out[done]
            rest = [r[len(p):] for p, r in zip(part, rest)]
        return logits

    def _forward_graph(self, rows: list[list[int]]) -> torch.Tensor:
        """A decode step through ``DecodeGraph``: every row writes its token's KV at its next column
        of the layers' whole buffers (padded to their rows and columns), attending to its real
        columns; positions, columns and the mask go in as tensors."""
        batch, width = self.batch_size, max(self.num_columns, max(self.ends) + 1)
        for layer in self.cache.layers:
            layer.reserve(width, layer.keys)
        pos, cols = list(self.lengths), list(self.ends)
        self.kv.mark_written({i: 1 for i in range(batch)}, width)
        buffers = [layer.buffers() for layer in self.cache.layers]
        cap_rows, cap_cols = buffers[0][0].shape[0], buffers[0][0].shape[2]
        pad = cap_rows - batch
        ids = self.kv.upload(torch.tensor([r[0] for r in rows] + [self.pad_id] * pad))
        mask = torch.zeros(cap_rows, cap_cols, dtype=torch.bool, device=self.device)
        mask[:batch, :width] = self.attn.bool()
        mask[batch:, 0] = True  # spare rows attend to something (their output is dropped)
        positions, columns = (self.kv.upload(torch.tensor(x + [0] * pad)) for x in (pos, cols))
        logits = self.graph(ids, positions, columns, mask, [k for k, _ in buffers], [v for _, v in buffers])
        return logits[:batch]

    def _step_staged(self, rows: list[list[int]], staged: dict[int, tuple[list, torch.Tensor]],
                     reselect: dict[int, int]) -> torch.Tensor:
        """Each staged row's first pending token (the marker's last) is fed, then its staged
        columns copied in with their keys rotated to the positions that follow (``reselect``: some
        of them recomputed in place), then its remaining pending tokens are fed after them."""
        widths = {i: self.surgery.check_staged(i, kv, shift, rows) for i, (kv, shift) in staged.items()}
        for i, k in reselect.items():
            if i not in widths or not isinstance(k, int) or not 0 <= k <= widths[i]:
                raise ValueError(f"row {i} reselects {k!r} tokens; it stages {widths.get(i, 0)}")
        reselect = {i: k for i, k in reselect.items() if k}
        self.surgery.rope()  # checked before anything is fed: the staged keys are re-rotated
        if reselect:
            self.surgery.decoder_layers()
        logits = self._forward([r[:1] for r in rows])
        plain = {i: kv for i, kv in staged.items() if i not in reselect}
        if plain:
            self.surgery.append_staged(plain, widths)
        if reselect:
            self._recompute_deviating(rows, {i: staged[i] for i in reselect}, widths, reselect)
        rest = [r[1 + widths.get(i, 0):] for i, r in enumerate(rows)]
        long = [i for i, r in enumerate(rest) if r]  # every staged row: it feeds a token after them
        logits[long] = self._forward(rest)[long]
        return logits

    def _recompute_deviating(self, rows: list[list[int]], staged, widths: dict[int, int],
                             reselect: dict[int, int]) -> None:
        """CacheBlend's selective recompute. The staged tokens go through the model's first
        ``KVSurgery.PROBE_LAYERS`` layers over the row's context (the forward stops there): layer 1
        is the first whose KV depends on what precedes a token. Then every layer gets the staged
        KV, and the ``reselect[i]`` tokens whose layer-1 values differ most from the staged ones
        are recomputed through the whole model, in place, each attending by position to the staged
        KV before it and the fresh KV of the others recomputed (``bench/zero_prefill_select.py``
        measures what this restores)."""
        probe = [rows[i][1 : 1 + widths[i]] if i in staged else [] for i in range(self.batch_size)]
        with stop_after(self.surgery.decoder_layers(), KVSurgery.PROBE_LAYERS):
            try:
                self._forward_packed(probe)  # one forward: the probe stops inside it
            except ProbeDone:
                pass
        at = {i: (self.ends[i] - widths[i], self.lengths[i] - widths[i]) for i in staged}  # first column, position
        chosen = self.surgery.choose_deviating(staged, widths, reselect, at)
        self.surgery.append_staged(staged, widths, at)
        feed = [[rows[i][1 + j] for j in chosen[i]] if i in chosen else [] for i in range(self.batch_size)]
        self._forward_packed(feed, at={i: ([at[i][0] + j for j in js], [at[i][1] + j for j in js])
                                       for i, js in chosen.items()})

    def _forward_columns(self, rows: list[list[int]]) -> torch.Tensor:
        """Every row's tokens as new right-hand columns, left-padded: a batch's first prompts, or
        rows feeding the same number of tokens over a cache without holes (a plain causal step)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros((len(rows), width), dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, start) in enumerate(zip(rows, self.lengths)):
            n = len(r)
            if n:
                ids[i, width - n :] = torch.tensor(r, dtype=torch.long)
                new_mask[i, width - n :] = 1
                pos[i, width - n :] = torch.arange(start, start + n)
            pos[i, : width - n] = start  # holes: any in-range position, they are masked out
        self.kv.append_columns(new_mask, [len(r) for r in rows])
        out = self.model(input_ids=self.kv.upload(ids), attention_mask=self.attn if self.has_holes else None,
                         position_ids=self.kv.upload(pos), **cache_kw(self.cache), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def _forward_packed(self, rows: list[list[int]], at: dict[int, tuple[list[int], list[int]]] | None = None
                        ) -> torch.Tensor:
        """Every fed token in one sequence ``[1, T]``, written at its row's next columns: one-token
        rows, evidence splices and new prompts in a single forward, parked rows costing nothing.
        Attention runs per row (``packed_attention``), so each token sees its own row only.

        ``at``: row -> (columns, positions) of tokens the row already holds, recomputed in place
        (each attends to its row's columns up to its own)."""
        fed = [i for i, r in enumerate(rows) if r]
        counts = [len(rows[i]) for i in fed]
        starts = [sum(counts[:j]) for j in range(len(fed))]
        ids = self.kv.upload(torch.tensor([[t for i in fed for t in rows[i]]]))
        if at is None:
            pos = torch.cat([torch.arange(self.lengths[i], self.lengths[i] + n) for i, n in zip(fed, counts)])
            cols = torch.cat([torch.arange(self.ends[i], self.ends[i] + n) for i, n in zip(fed, counts)])
            width = max(self.num_columns, *(self.ends[i] + n for i, n in zip(fed, counts)))
            self.kv.mark_written(dict(zip(fed, counts)), width)
        else:
            pos = torch.tensor([p for i in fed for p in at[i][1]])
            cols = torch.tensor([c for i in fed for c in at[i][0]])
            width = self.num_columns
        cols = self.kv.upload(cols)
        row_of = self.kv.upload(torch.repeat_interleave(torch.tensor(fed), torch.tensor(counts)))
        plan = packed_plan(self.model, self.attn.bool(), fed, counts, starts, cols, self.kv.upload,
                           in_place=at is not None)
        for layer in self.cache.layers:
            layer.scatter = (row_of, cols, width)
        try:
            with attention_implementation(self.model.config, PACKED_ATTENTION):
                last = self.kv.upload(torch.tensor([s + n - 1 for s, n in zip(starts, counts)]))
                out = self.model(input_ids=ids, position_ids=self.kv.upload(pos[None]), **cache_kw(self.cache),
                                 use_cache=True, rig_packed=plan, logits_to_keep=last)
        finally:
            for layer in self.cache.layers:
                layer.scatter = None
        logits = out.logits[0].float()
        if len(fed) == self.batch_size:
            return logits
        full = logits.new_zeros(self.batch_size, logits.shape[-1])
        full[fed] = logits
        return full

    # -- removing rows, tokens and holes -----------------------------------------------------------

    def evict(self, row: int, start: int, end: int) -> None:
        """Drop the row's cached tokens ``start:end`` (counting its real tokens); the keys after
        them move back by ``end - start`` positions (``KVSurgery.evict``)."""
        self.surgery.evict(row, start, end)

    def drop_last(self, n: int) -> None:
        """Forget every row's last ``n`` tokens (``RowCache.drop_last``): benchmarks repeat a step this way."""
        self.kv.drop_last(n)

    def select(self, keep: list[int]) -> None:
        """Keep only these rows (finished ones leave the batch and free their cache)."""
        if keep != list(range(self.batch_size)):
            self._capture.clear()
        self.kv.select(keep)

    def compact(self, force: bool = False) -> None:
        """Left-align every row's tokens and drop spare columns (``RowCache.compact``)."""
        self.kv.compact(force)


def common_prefix(rows: list[list[int]]) -> list[int]:
    first, n = rows[0], len(rows[0])
    for r in rows[1:]:
        n = min(n, len(r))
        for j in range(n):
            if r[j] != first[j]:
                n = j
                break
    return first[:n]
