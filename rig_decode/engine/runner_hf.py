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

The cache's layers are ``models.kv_buffers.BufferedLayer``s: writes land in place, in buffers with
spare rows and columns.

A row can also drop a span of its tokens (``evict``) and take precomputed KV (``step(...,
staged=)``, zero-prefill evidence): both move keys to new positions, see ``engine/staging.py``.

Prompts share their start (the system prompt). The runner keeps the KV of the last prompt prefix
it computed; because attention is causal, the KV of any prefix of it is valid for any prompt that
starts the same way, so a new row is seeded (at its left) with the longest common prefix and
prefills the rest.

Only full-attention models are served (every cache layer a ``BufferedLayer``): a sliding window
would count hole columns as tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from ..kernels import RopeSpec, to_device
from ..models.cache_arg import cache_kw
from ..models.kv_buffers import BufferedLayer, new_cache
from ..models.packed_attention import PACKED_ATTENTION, attention_implementation, packed_plan
from .staging import KVSurgery


class HFModelRunner(KVSurgery):
    MIN_SHARED_PREFIX = 16
    COMPACT_AT = 0.25  # compact once this share of the columns lies beyond the longest row's length

    def __init__(self, model, pad_id: int, max_slots: int | None = None):
        """``max_slots``: token slots (rows x columns) the cache's buffers may hold, spare room
        included (the engine's KV budget; ``BufferedLayer`` says how it bounds them); None: no
        bound."""
        self.model, self.pad_id, self.max_slots = model, pad_id, max_slots
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.attn: torch.Tensor | None = None  # [B, columns], 1 = real token
        self.lengths: list[int] = []  # real tokens each row has in the cache
        self.ends: list[int] = []  # each row's next free column: after its last real token (or an evicted tail)
        self._prefix: tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._capture: dict[int, list[int]] = {}  # row -> its prompt, whose KV becomes the cached prefix once fed
        self._rope: RopeSpec | None = None  # how the model rotates its keys, on first use

    @property
    def context_limit(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def num_columns(self) -> int:
        return 0 if self.attn is None else self.attn.shape[1]

    @property
    def has_holes(self) -> bool:
        """Whether some row does not attend to every column (padding, an evicted span, a parked
        row's columns): read from the rows' real-token counts on the host, not from the device."""
        return any(n != self.num_columns for n in self.lengths)

    @property
    def num_slots(self) -> int:
        """Token slots in use (rows x columns), holes included (``reserved_slots``: what is allocated)."""
        return self.batch_size * self.num_columns

    @property
    def reserved_slots(self) -> int:
        """Token slots the cache's buffers hold, spare rows and columns included: what memory is
        allocated (per layer; times ``kv_bytes_per_token_of(model)`` for bytes)."""
        return 0 if self.cache is None else max(layer.capacity for layer in self.cache.layers)

    def reset(self, batch_size: int = 0) -> None:
        self.cache = new_cache(self.model.config, self.max_slots)
        other = {type(layer).__name__ for layer in self.cache.layers if not isinstance(layer, BufferedLayer)}
        if other:
            raise ValueError(f"the runner serves full-attention models only; this one has {', '.join(sorted(other))} "
                             "cache layers (sliding-window or linear attention)")
        self.attn = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = [0] * batch_size
        self.ends = [0] * batch_size
        self._capture = {}

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
        if self.cache is None:
            self.reset(0)
        if not share_prefix:
            self._grow(len(prompts), columns=0)
            return [list(p) for p in prompts]
        # Several prompts: the part they all share becomes the cached prefix, computed once (only what
        # the cache does not hold yet). A lone prompt is prefilled in the step, with the other rows;
        # its KV then becomes the cached prefix (``_capture_prefix``), e.g. for the next turn.
        if len(prompts) > 1:
            shared = common_prefix(prompts)[: min(len(p) for p in prompts) - 1]
            if len(shared) >= self.MIN_SHARED_PREFIX and len(shared) > self._cached(shared):
                self._compute_prefix(shared)
        elif len(prompts[0]) >= self.MIN_SHARED_PREFIX and len(prompts[0]) > self._cached(prompts[0]):
            self._capture[self.batch_size] = list(prompts[0])
        seeds = [min(self._cached(p), len(p) - 1) for p in prompts]  # every row feeds >= 1 token
        seeds = [n if n >= self.MIN_SHARED_PREFIX else 0 for n in seeds]
        first, n_new, width = self.batch_size, len(prompts), max(seeds)
        self._grow(n_new, columns=max(0, width - self.num_columns))
        if width:  # a new row starts at the left, like every row
            for layer, (k, v) in zip(self.cache.layers, self._prefix[1]):
                keys, values = layer.keys, layer.values
                for j, n in enumerate(seeds):
                    if n:
                        keys[first + j, :, :n] = k[0, :, :n]
                        values[first + j, :, :n] = v[0, :, :n]
            for j, n in enumerate(seeds):
                if n:
                    self.attn[first + j, :n] = 1
                    self.lengths[first + j] = self.ends[first + j] = n
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
        self.model(input_ids=torch.tensor([ids[known:]], device=self.device),
                   position_ids=torch.arange(known, len(ids), device=self.device)[None],
                   **cache_kw(one), use_cache=True, logits_to_keep=1)
        self._prefix = (list(ids), [(layer.keys, layer.values) for layer in one.layers])

    def _grow(self, rows: int, columns: int) -> None:
        """Add ``rows`` rows of holes, and ``columns`` hole columns at the right of every row."""
        if rows == 0 and columns == 0:
            return
        if self.cache.get_seq_length() == 0:  # nothing cached yet: no tensors to grow
            if columns:
                self._materialise(self.batch_size + rows, columns)
            else:
                self.attn = torch.zeros(self.batch_size + rows, 0, dtype=torch.long, device=self.device)
        else:
            for layer in self.cache.layers:
                layer.grow(rows, columns)
            self.attn = torch.nn.functional.pad(self.attn, (0, columns, 0, rows))
        self.lengths += [0] * rows
        self.ends += [0] * rows

    def _materialise(self, batch: int, columns: int) -> None:
        k0, v0 = self._prefix[1][0]
        for layer, (k, v) in zip(self.cache.layers, self._prefix[1]):
            shape = (batch, k.shape[1], columns, k.shape[3])
            keys, values = k.new_zeros(shape), v.new_zeros(shape)
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        self.attn = torch.zeros(batch, columns, dtype=torch.long, device=self.device)

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
        chosen as CacheBlend does (``_select_deviating``)."""
        assert self.cache is not None and len(rows) == self.batch_size, "rows must match the batch"
        if staged:
            return self._step_staged(rows, staged, reselect or {})
        if reselect:
            raise ValueError("reselect names staged tokens, but nothing is staged")
        lens = [len(r) for r in rows]
        if not any(lens):
            raise ValueError("no row has anything to feed")
        if self.cache.get_seq_length() == 0 or (not self.has_holes and len(set(lens)) == 1):
            logits = self._forward_columns(rows)
        else:
            logits = self._forward_packed(rows)
        if self._capture:
            self._capture_prefix()
        return logits

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

    def _mark_written(self, counts: dict[int, int], width: int) -> None:
        """Rows ``i`` now hold ``counts[i]`` more real tokens at their next columns; the cache is
        ``width`` columns wide."""
        if width > self.num_columns:
            self.attn = torch.nn.functional.pad(self.attn, (0, width - self.num_columns))
        for i, n in counts.items():
            self.attn[i, self.ends[i] : self.ends[i] + n] = 1
            self.lengths[i] += n
            self.ends[i] += n

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
        self.attn = torch.cat([self.attn, self._upload(new_mask)], dim=1)
        self.lengths = [n + len(r) for n, r in zip(self.lengths, rows)]
        self.ends = [self.num_columns if r else e for e, r in zip(self.ends, rows)]
        out = self.model(input_ids=self._upload(ids), attention_mask=self.attn if self.has_holes else None,
                         position_ids=self._upload(pos), **cache_kw(self.cache), use_cache=True, logits_to_keep=1)
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
        ids = self._upload(torch.tensor([[t for i in fed for t in rows[i]]]))
        if at is None:
            pos = torch.cat([torch.arange(self.lengths[i], self.lengths[i] + n) for i, n in zip(fed, counts)])
            cols = torch.cat([torch.arange(self.ends[i], self.ends[i] + n) for i, n in zip(fed, counts)])
            width = max(self.num_columns, *(self.ends[i] + n for i, n in zip(fed, counts)))
            self._mark_written(dict(zip(fed, counts)), width)
        else:
            pos = torch.tensor([p for i in fed for p in at[i][1]])
            cols = torch.tensor([c for i in fed for c in at[i][0]])
            width = self.num_columns
        cols = self._upload(cols)
        row_of = self._upload(torch.repeat_interleave(torch.tensor(fed), torch.tensor(counts)))
        plan = packed_plan(self.model, self.attn.bool(), fed, counts, starts, cols, self._upload,
                           in_place=at is not None)
        for layer in self.cache.layers:
            layer.scatter = (row_of, cols, width)
        try:
            with attention_implementation(self.model.config, PACKED_ATTENTION):
                last = self._upload(torch.tensor([s + n - 1 for s, n in zip(starts, counts)]))
                out = self.model(input_ids=ids, position_ids=self._upload(pos[None]), **cache_kw(self.cache),
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

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the model's device, queued on the stream without waiting for the GPU's
        work (``kernels.to_device``), so a hop's second forward can be queued while its first still runs."""
        return to_device(t, self.device)

    # -- removing rows, tokens and holes -----------------------------------------------------------

    def drop_last(self, n: int) -> None:
        """Forget every row's last ``n`` tokens, which must be its last ``n`` columns (a lone row,
        or rows that all fed the same number of tokens since): benchmarks repeat a step this way."""
        width = self.num_columns - n
        if n < 1 or width < 0 or any(e != self.num_columns for e in self.ends) or not bool(self.attn[:, width:].all()):
            raise ValueError(f"cannot drop the last {n} tokens: they are not every row's last {n} columns")
        self._truncate(width)
        self.lengths = [x - n for x in self.lengths]
        self.ends = [width] * self.batch_size

    def _truncate(self, width: int) -> None:
        """Drop every column from ``width`` on (views: nothing is copied)."""
        for layer in self.cache.layers:
            layer.truncate(width)
        self.attn = self.attn[:, :width]

    def select(self, keep: list[int]) -> None:
        """Keep only these rows (finished ones leave the batch and free their cache)."""
        if keep == list(range(self.batch_size)):
            return
        if any(not isinstance(i, int) or not 0 <= i < self.batch_size for i in keep):
            raise ValueError(f"cannot keep rows {keep}: the batch has rows 0..{self.batch_size - 1}")
        self._capture.clear()
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if keep and self.cache.get_seq_length():
            for layer in self.cache.layers:
                layer.select_rows(keep)
        self.attn = self.attn.index_select(0, idx)
        self.lengths = [self.lengths[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        if not keep:
            self.reset(0)
            return
        self._truncate(max(self.ends))  # the columns past every row's last token
        self.compact(force=True)  # the KV budget counts columns as wide as the longest row

    def compact(self, force: bool = False) -> None:
        """Left-align every row's tokens and drop the columns beyond the longest row's length (when
        they are ``COMPACT_AT`` of the columns, or always with ``force``). The spare columns of a row
        shorter than the longest stay: that row fills them as it decodes."""
        if not self.batch_size or not self.num_columns:
            return
        width = max(self.lengths)
        spare = self.num_columns - width
        if spare == 0 or (not force and spare < self.COMPACT_AT * self.num_columns):
            return
        # For each row, the source column of each target column: real columns first, in order.
        order = torch.argsort(self.attn, dim=1, descending=True, stable=True)[:, :width]
        new_mask = torch.gather(self.attn, 1, order)
        moved = (order != torch.arange(width, device=self.device)).any(dim=1).nonzero().flatten().tolist()
        for layer in self.cache.layers:
            layer.gather_columns(order, moved)
        self.attn = new_mask
        self.ends = list(self.lengths)


def common_prefix(rows: list[list[int]]) -> list[int]:
    first, n = rows[0], len(rows[0])
    for r in rows[1:]:
        n = min(n, len(r))
        for j in range(n):
            if r[j] != first[j]:
                n = j
                break
    return first[:n]
