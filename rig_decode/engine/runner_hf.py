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
  (``packed_attention``) lets each token attend over its own row only: the one-token rows as one
  batch over the whole cache, each longer row over a view of its own cache row, both through the
  model's own attention (sdpa or eager). The weights are read once for the whole step; no row's
  cache is copied, and a row behind the widest one fills its own spare columns.
* A batch's first prompts (an empty cache), or rows feeding the same number of tokens over a cache
  without holes (a lone row, rows in lockstep), go in one plain forward as new right-hand columns.

Keys carry their rotary position already, so attention does not care which column holds a key.
``compact`` moves every row's tokens to the left end, so the cache is as wide as its longest row
(it drops leading holes of first prompts and evicted spans): when a row leaves the batch, and
whenever the columns beyond the longest row's length are a quarter of the columns.

The cache's layers keep their keys and values in buffers with spare columns (``BufferedLayer``): a
write lands in place, where a plain ``DynamicCache`` concatenates, i.e. copies (and page-faults in
fresh memory for) the whole cache every step; at 16 rows x 1,000 columns that copy was a third of
the step on CPU.

A row can drop a span of its tokens (``evict``): the span's columns become holes and the keys after
it are rotated back by the span's length (``kernels.rope_shift_layers_``), so the row's positions stay
contiguous and the next token sits right after the last kept one. Tokens after the span keep what
they computed while attending to it: eviction is an approximation, used by ``append_format:
summary`` (an evidence block is dropped once the model has written past it).

A row can also take precomputed KV (``step(..., staged=)``, zero-prefill evidence, see
``kernels/chunk_kv.py``): its first pending token (the marker's last) is fed, then the staged
columns are copied in with their keys rotated to the positions that follow, then its remaining
pending tokens are fed after them. Nothing of the staged tokens goes through the model, unless
``reselect`` asks for CacheBlend's selective recompute (``_select_deviating``): the staged tokens
that deviate most from their in-context KV are recomputed in place, at their own columns.

Prompts share their start (the system prompt). The runner keeps the KV of the last prompt prefix
it computed; because attention is causal, the KV of any prefix of it is valid for any prompt that
starts the same way, so a new row is seeded (at its left) with the longest common prefix and
prefills the rest.

Only full-attention models are served (every cache layer a ``BufferedLayer``): a sliding window
would count hole columns as tokens.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..kernels import RopeSpec, rope_of, rope_shift_layers_, to_device
from ..kernels.chunk_kv import value_deviation
from ..kernels.rope import decoder_of
from ..models.cache_arg import cache_kw

PACKED_ATTENTION = "rig_packed"


@dataclass(frozen=True, slots=True)
class PackedStep:
    """How a packed step's tokens attend: the one-token rows together, over the whole batch's cache
    (``single_rows`` None: every row, in order), and each longer row's span over its own row."""

    attend: Callable  # the model's own attention function (sdpa, or its eager one)
    batch: int
    single_tokens: torch.Tensor | None  # packed index of each one-token row's token
    single_rows: torch.Tensor | None
    single_mask: torch.Tensor | None  # [B, 1, 1, columns]
    spans: list[tuple[int, int, int, torch.Tensor]]  # (row, first packed index, tokens, mask [1, 1, n, columns])


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, rig_packed=None, **kwargs):
    """Attention for a packed step. ``query`` ``[1, heads, T, dim]`` holds every fed token,
    ``key``/``value`` the batch's cache ``[B, kv_heads, columns, dim]`` with the new tokens written
    (``BufferedLayer.scatter``); each token attends over its own row only. No copy of the cache:
    one-token rows go as one batch over all rows (other rows get a zero query, their output dropped),
    each longer row over a view of its own row."""
    p: PackedStep = rig_packed
    if p.single_tokens is not None and p.single_rows is None and not p.spans:  # a decode step: one token per row
        o, _ = p.attend(module, query[0].transpose(0, 1).unsqueeze(2), key, value, p.single_mask,
                        scaling=scaling, dropout=dropout, **kwargs)
        return o.transpose(0, 1), None
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    if p.single_tokens is not None:
        q = query[0, :, p.single_tokens].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        if p.single_rows is not None:
            q = q.new_zeros(p.batch, *q.shape[1:]).index_copy_(0, p.single_rows, q)
        o, _ = p.attend(module, q, key, value, p.single_mask, scaling=scaling, dropout=dropout, **kwargs)
        out[0, p.single_tokens] = o[:, 0] if p.single_rows is None else o[p.single_rows, 0]
    for row, start, n, mask in p.spans:
        o, _ = p.attend(module, query[:, :, start : start + n], key[row : row + 1], value[row : row + 1], mask,
                        scaling=scaling, dropout=dropout, **kwargs)
        out[0, start : start + n] = o[0]
    return out, None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def _model_attention(model) -> tuple[Callable, bool]:
    """The attention function the model is set to use, and whether it takes an additive float mask
    (eager) rather than a boolean one (sdpa; also what any other implementation falls back to)."""
    if model.config._attn_implementation == "eager":
        eager = getattr(importlib.import_module(type(model).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager, True
    return sdpa_attention_forward, False


def _additive_mask(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive float mask eager attention takes."""
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)


@contextmanager
def _attention_implementation(config, name: str):
    """Run the model with another registered attention implementation (with no mask function
    registered for it, the model builds no mask: the attention function brings its own)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are the first rows and columns of a larger buffer.

    ``update`` writes new columns in place while the buffer has room and otherwise moves to one
    ``HEADROOM`` wider, so growth is amortised. Spare rows come only with rows joining (``grow``): a
    lone long row must not pay for a second one it may never get (a 32B model's 8k-token row is
    2 GiB of KV). ``max_slots`` (token slots, rows x columns: the engine's KV budget) bounds the
    spare room: spare rows go first, then spare columns, but never below ``MIN_SPARE`` columns, so
    a cache at its budget still moves once per ``MIN_SPARE`` steps rather than at every step (rows
    that fit the bound exceed it by at most that many columns each). The runner's re-layouts work in
    place in a buffer the layer allocated: ``grow`` (rows joining, wider rows) zeroes spare rows and
    columns, ``select_rows`` (rows leaving) moves only the rows after a leaving one, and
    ``gather_columns`` (compaction) moves only the rows whose tokens are not already left-aligned;
    a join or leave neither copies the whole cache nor touches fresh memory. Assigning
    ``keys``/``values`` installs that exact tensor: appends and re-layouts move to a buffer of the
    layer's own rather than write into it. Per-token writes (``scatter``) and ``reserve`` do write
    into the columns the layer holds: the runner installs only tensors it owns.
    """

    HEADROOM = 0.25
    MIN_SPARE = 64

    def __init__(self, max_slots: int | None = None):
        super().__init__()
        self.max_slots = max_slots
        self._k = self._v = None
        self._nk = self._nv = 0
        self._bk = self._bv = 0  # rows in use (of the buffer's rows)
        self._owned = False  # the buffers are the layer's own (re-layouts may write into them)
        self.scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None
        """Set by the runner for a packed step: new token j goes to row ``rows[j]``, column
        ``cols[j]``, of a layer ``width`` columns wide."""

    @staticmethod
    def _view(buf, rows, n):
        return buf if buf is None or buf.dim() != 4 else buf[:rows, :, :n]

    @staticmethod
    def _width(t):
        return t.shape[-2] if t is not None and t.dim() == 4 else 0

    @property
    def keys(self):
        return self._view(self._k, self._bk, self._nk)

    @keys.setter
    def keys(self, t):
        self._k, self._nk, self._bk, self._owned = t, self._width(t), self._batch(t), False

    @property
    def values(self):
        return self._view(self._v, self._bv, self._nv)

    @values.setter
    def values(self, t):
        self._v, self._nv, self._bv, self._owned = t, self._width(t), self._batch(t), False

    @staticmethod
    def _batch(t):
        return t.shape[0] if t is not None and t.dim() == 4 else 0

    @property
    def batch(self) -> int:
        return self._bk

    def _has_room(self, rows: int, width: int) -> bool:
        return self._owned and self._k.shape[0] >= rows and self._k.shape[2] >= width

    @property
    def capacity(self) -> int:
        """Token slots (rows x columns) the buffers hold, spare room included: what memory is spent on."""
        return 0 if self._k is None or self._k.dim() != 4 else self._k.shape[0] * self._k.shape[2]

    def _join_room(self, rows: int) -> int:
        """Spare rows a buffer for ``rows`` rows gets once rows join."""
        return max(1, int(rows * self.HEADROOM))

    def _own(self) -> None:
        """Move an installed tensor into buffers of the layer's own, so re-layouts may write into them."""
        if not self._owned:
            self._move_to_new_buffers(self._k, self.batch, self._nk)

    def _move_to_new_buffers(self, like: torch.Tensor, rows: int, width: int, spare_rows: int = 0) -> None:
        """Move to buffers of the layer's own with room for ``rows`` + ``spare_rows`` rows and spare
        columns beyond ``width`` (within ``max_slots``), keeping what the layer holds (``like``: a
        tensor of the cache's heads, dtype and head size)."""
        cap_rows, spare = rows + spare_rows, max(self.MIN_SPARE, int(width * self.HEADROOM))
        if self.max_slots is not None:  # spare rows go first, then spare columns down to MIN_SPARE
            cap_rows = max(rows, min(cap_rows, self.max_slots // (width + spare)))
            spare = max(self.MIN_SPARE, min(spare, self.max_slots // max(1, cap_rows) - width))
        k, v = (like.new_empty(cap_rows, like.shape[1], width + spare, like.shape[3]) for _ in range(2))
        b, n = self.batch, self._nk
        if n:
            k[:b, :, :n], v[:b, :, :n] = self.keys, self.values
        self._k, self._v, self._bk, self._bv, self._owned = k, v, b, b, True

    def reserve(self, width: int, like: torch.Tensor, zero: bool = True) -> None:
        """Make the layer ``width`` columns wide (new columns zeroed unless ``zero`` is off), moving
        to a larger buffer when this one has no room. ``like``: a tensor of the layer's batch,
        heads, dtype and head size."""
        n, rows = self._nk, like.shape[0]
        if not self._has_room(rows, width):
            # Keep spare rows that joins made, up to what a join would make now (rows that left
            # are not kept room for).
            spare = min(self._k.shape[0] - rows, self._join_room(rows)) if self._owned else 0
            self._move_to_new_buffers(like, rows, width, spare_rows=max(0, spare))
        self._bk = self._bv = rows  # rows may have joined while no column was cached
        if zero and width > n:
            self._k[: self._bk, :, n:width] = 0
            self._v[: self._bv, :, n:width] = 0
        self._nk = self._nv = max(n, width)

    def grow(self, rows: int, columns: int) -> None:
        """Add ``rows`` zero rows, and ``columns`` zero columns at the right of every row."""
        b, n = self.batch, self._nk
        width = n + columns
        if not self._has_room(b + rows, width):
            self._move_to_new_buffers(self._k, b + rows, width, spare_rows=self._join_room(b + rows))
        for buf in (self._k, self._v):
            buf[:b, :, n:width] = 0
            buf[b : b + rows, :, :width] = 0
        self._bk = self._bv = b + rows
        self._nk = self._nv = width

    def select_rows(self, keep: list[int]) -> None:
        """Keep only rows ``keep``, in that order, in place."""
        self._own()
        n = self._nk
        if keep == sorted(set(keep)):  # each kept row moves up or stays: none is overwritten before it is read
            for j, i in enumerate(keep):
                if i != j:
                    self._k[j, :, :n] = self._k[i, :, :n]
                    self._v[j, :, :n] = self._v[i, :, :n]
        else:
            index = torch.tensor(keep, device=self._k.device)
            for buf in (self._k, self._v):
                buf[: len(keep), :, :n] = buf[index, :, :n]
        self._bk = self._bv = len(keep)

    def gather_columns(self, order: torch.Tensor, rows: list[int]) -> None:
        """Column ``j`` of row ``r`` becomes its column ``order[r, j]`` (``order``: ``[batch, width]``);
        only ``rows`` move, the others' first ``width`` columns are already in that order."""
        self._own()
        width = order.shape[1]
        for r in rows:
            self._k[r, :, :width] = self._k[r, :, order[r]]
            self._v[r, :, :width] = self._v[r, :, order[r]]
        self._nk = self._nv = width

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.scatter is not None:  # packed tokens [1, heads, T, dim], each to its own row and column
            rows, cols, width = self.scatter
            self.write(rows, cols, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), width)
            return self.keys, self.values
        n, w = self._nk, key_states.shape[-2]
        self.reserve(n + w, key_states, zero=False)
        self._k[: self._bk, :, n : n + w] = key_states
        self._v[: self._bv, :, n : n + w] = value_states
        return self.keys, self.values

    def write(self, rows: torch.Tensor, cols: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              width: int) -> None:
        """Write token ``j``'s key and value (``[T, kv_heads, dim]``) at row ``rows[j]``, column
        ``cols[j]``; the layer becomes ``width`` columns wide (at least)."""
        self.reserve(width, self.keys)
        self._k[rows, :, cols] = keys
        self._v[rows, :, cols] = values

    def truncate(self, width: int) -> None:
        """Drop every column from ``width`` on (a view: nothing is copied)."""
        self._nk = self._nv = min(self._nk, width)

    def get_seq_length(self) -> int:
        return self._nk


def new_cache(config, max_slots: int | None = None) -> DynamicCache:
    """A ``DynamicCache`` whose full-attention layers are ``BufferedLayer``s (whose spare room
    ``max_slots`` bounds)."""
    cache = DynamicCache(config=config)
    cache.layers = [BufferedLayer(max_slots) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class _ProbeDone(Exception):
    """Stops a forward after the layers a probe needs (``HFModelRunner._select_deviating``)."""


def _stop_probe(module, args):
    raise _ProbeDone


class HFModelRunner:
    MIN_SHARED_PREFIX = 16
    PROBE_LAYERS = 2  # layers a CacheBlend probe runs: layer 1 is the first whose KV depends on the context
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
            shared = _common_prefix(prompts)[: min(len(p) for p in prompts) - 1]
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
        return 0 if self._prefix is None else len(_common_prefix([self._prefix[0], ids]))

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

    def _step_staged(self, rows: list[list[int]], staged: dict[int, tuple[list, torch.Tensor]],
                     reselect: dict[int, int]) -> torch.Tensor:
        widths = {i: self._check_staged(i, kv, shift, rows) for i, (kv, shift) in staged.items()}
        for i, k in reselect.items():
            if i not in widths or not isinstance(k, int) or not 0 <= k <= widths[i]:
                raise ValueError(f"row {i} reselects {k!r} tokens; it stages {widths.get(i, 0)}")
        reselect = {i: k for i, k in reselect.items() if k}
        self._rope_of_model()  # checked before anything is fed: the staged keys are re-rotated
        if reselect:
            self._decoder_layers()
        # A joining row's prompt is whole in the cache only after the last of the steps below.
        capture, self._capture = self._capture, {}
        logits = self.step([r[:1] for r in rows])
        plain = {i: kv for i, kv in staged.items() if i not in reselect}
        if plain:
            self._append_staged(plain, widths)
        if reselect:
            self._select_deviating(rows, {i: staged[i] for i in reselect}, widths, reselect)
        self._capture = capture
        rest = [r[1 + widths.get(i, 0):] for i, r in enumerate(rows)]
        long = [i for i, r in enumerate(rest) if r]  # every staged row: it feeds a token after them
        logits[long] = self.step(rest)[long]
        return logits

    def _decoder_layers(self):
        layers = getattr(decoder_of(self.model), "layers", None)
        if layers is None:
            raise ValueError(f"{type(self.model).__name__} has no model.layers: CacheBlend's probe cannot stop "
                             "its forward at layer 2")
        return layers

    def _check_staged(self, row: int, kv: list, shift: torch.Tensor, rows: list[list[int]]) -> int:
        """The number of tokens row ``row`` stages, once its KV and shifts fit the cache and the
        tokens it feeds (checked before anything is fed or written)."""
        layers = self.cache.layers
        if not 0 <= row < self.batch_size:
            raise ValueError(f"staged row {row} is not in the batch of {self.batch_size}")
        if len(kv) != len(layers):
            raise ValueError(f"row {row} stages KV for {len(kv)} layers; the model has {len(layers)}")
        like = layers[0].keys
        if like is None or like.dim() != 4:
            raise ValueError("nothing is cached yet: staged KV follows tokens the rows already hold")
        n = kv[0][0].shape[2]
        want = (1, like.shape[1], n, like.shape[3])
        for li, pair in enumerate(kv):
            for t in pair:
                if tuple(t.shape) != want or t.dtype != like.dtype:
                    raise ValueError(f"row {row}, layer {li}: staged KV is {tuple(t.shape)} {t.dtype}, "
                                     f"expected {want} {like.dtype}")
        if tuple(shift.shape) != (n,):
            raise ValueError(f"row {row} stages {n} tokens but gives {tuple(shift.shape)} shifts")
        if len(rows[row]) < n + 2:
            raise ValueError(f"row {row} stages {n} tokens but feeds only {len(rows[row])}: it needs its first token "
                             "before them and at least one after")
        return n

    def _select_deviating(self, rows: list[list[int]], staged, widths: dict[int, int],
                          reselect: dict[int, int]) -> None:
        """CacheBlend's selective recompute. The staged tokens go through the model's first
        ``PROBE_LAYERS`` layers over the row's context (the forward stops there): layer 1 is the
        first whose KV depends on what precedes a token. Then every layer gets the staged KV, and
        the ``reselect[i]`` tokens whose layer-1 values differ most from the staged ones are
        recomputed through the whole model, in place, each attending by position to the staged KV
        before it and the fresh KV of the others recomputed (``bench/zero_prefill_select.py``
        measures what this restores, and that keeping the probe's own KV of layers 0-1 instead of
        the staged KV changes almost nothing: ``--keep-probe-kv``)."""
        probe = [rows[i][1 : 1 + widths[i]] if i in staged else [] for i in range(self.batch_size)]
        layers = self._decoder_layers()
        stop = (layers[self.PROBE_LAYERS].register_forward_pre_hook(_stop_probe)
                if len(layers) > self.PROBE_LAYERS else None)
        try:
            self.step(probe)
        except _ProbeDone:
            pass
        finally:
            if stop is not None:
                stop.remove()
        at = {i: (self.ends[i] - widths[i], self.lengths[i] - widths[i]) for i in staged}  # first column, position
        probed = min(1, len(self.cache.layers) - 1)
        fresh = self.cache.layers[probed].values
        top = []
        for i, k in reselect.items():
            col = at[i][0]
            in_context = fresh[i, :, col : col + widths[i]]  # [kv_heads, n, head_dim]
            reused = staged[i][0][probed][1][0].to(in_context.device)
            top.append(value_deviation(reused, in_context).topk(k).indices)
        top = torch.cat(top).tolist()  # one device sync for the hop
        chosen, start = {}, 0
        for i, k in reselect.items():
            chosen[i], start = sorted(top[start : start + k]), start + k
        self._append_staged(staged, widths, at)
        feed = [[rows[i][1 + j] for j in chosen[i]] if i in chosen else [] for i in range(self.batch_size)]
        self._forward_packed(feed, at={i: ([at[i][0] + j for j in js], [at[i][1] + j for j in js])
                                       for i, js in chosen.items()})

    def _append_staged(self, staged, widths: dict[int, int], at: dict[int, tuple[int, int]] | None = None) -> None:
        """Copy staged KV into each staged row's next columns, keys rotated from piece-local
        positions to the row's next positions; or, with ``at`` (row -> first column and position),
        over columns the row already holds."""
        widths = {i: widths[i] for i in staged}
        rows_idx, cols_idx, shift = [], [], []
        for i, (_, local) in staged.items():
            n = widths[i]
            end, length = at[i] if at else (self.ends[i], self.lengths[i])
            rows_idx.append(torch.full((n,), i, dtype=torch.long))
            cols_idx.append(torch.arange(end, end + n))
            shift.append(local.float().cpu() + length)  # ChunkKVStore's shifts are on the host already
        # rope_shift_layers_ bounds-checks host indices without a device sync; layer.write needs them on the device.
        rows_idx, cols_idx, shift = torch.cat(rows_idx), torch.cat(cols_idx), torch.cat(shift)
        rows_dev, cols_dev = self._upload(rows_idx), self._upload(cols_idx)
        width = self.num_columns if at else max(self.num_columns, *(self.ends[i] + n for i, n in widths.items()))
        for li, layer in enumerate(self.cache.layers):
            keys, values = ([kv[li][part][0].transpose(0, 1) for kv, _ in staged.values()] for part in (0, 1))
            layer.write(rows_dev, cols_dev, torch.cat(keys).to(self.device), torch.cat(values).to(self.device), width)
        if not at:
            self._mark_written(widths, width)
        self._shift_keys(rows_idx, cols_idx, shift)

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
        plan = self._packed_plan(fed, counts, starts, cols, in_place=at is not None)
        for layer in self.cache.layers:
            layer.scatter = (row_of, cols, width)
        try:
            with _attention_implementation(self.model.config, PACKED_ATTENTION):
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

    def _packed_plan(self, fed: list[int], counts: list[int], starts: list[int], cols: torch.Tensor,
                     in_place: bool = False) -> PackedStep:
        """The masks of a packed step (the new tokens already marked in ``attn``): a one-token row
        sees its real columns; token ``j`` of a longer row sees its row's real columns up to its own.
        ``in_place`` (tokens recomputed among columns the row holds): every row as a longer one."""
        attend, additive = _model_attention(self.model)

        def mask(m: torch.Tensor) -> torch.Tensor:
            return _additive_mask(m, self.model.dtype) if additive else m

        real = self.attn.bool()
        column = torch.arange(self.num_columns, device=self.device)
        single = 0 if in_place else 1
        singles = [(i, s) for i, n, s in zip(fed, counts, starts) if n == single]
        spans = [(i, s, n, mask((real[i] & (column <= cols[s : s + n, None]))[None, None]))
                 for i, n, s in zip(fed, counts, starts) if n != single]
        if not singles:
            return PackedStep(attend, self.batch_size, None, None, None, spans)
        single_rows = [i for i, _ in singles]
        every_row = single_rows == list(range(self.batch_size))
        return PackedStep(attend, self.batch_size, self._upload(torch.tensor([s for _, s in singles])),
                          None if every_row else self._upload(torch.tensor(single_rows)),
                          mask(real[:, None, None, :]), spans)

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the model's device, queued on the stream without waiting for the GPU's
        work (``kernels.to_device``), so a hop's second forward can be queued while its first still runs."""
        return to_device(t, self.device)

    def _rope_of_model(self) -> RopeSpec:
        """How the model rotates its keys (``kernels.rope_of``, checked once), its ``inv_freq`` on the device."""
        if self._rope is None:
            spec = rope_of(self.model)
            self._rope = spec._replace(inv_freq=spec.inv_freq.to(self.device))
        return self._rope

    def _shift_keys(self, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor) -> None:
        """Rotate the cached keys at ``(rows[n], cols[n])`` by ``shift[n]`` positions, in every layer
        that encodes positions in its keys (a NoPE layer's keys move as they are)."""
        rope = self._rope_of_model()
        rope_shift_layers_([self.cache.layers[i].keys for i in rope.layers], rows, cols, shift, rope.inv_freq,
                           rope.interleaved)

    # -- removing rows, tokens and holes -----------------------------------------------------------

    @torch.no_grad()
    def evict(self, row: int, start: int, end: int) -> None:
        """Drop the row's cached tokens ``start:end`` (counting its real tokens) and move the keys
        after them back by ``end - start`` positions."""
        if not isinstance(row, int) or not 0 <= row < self.batch_size:
            raise ValueError(f"cannot evict from row {row}: the batch has rows 0..{self.batch_size - 1}")
        n = self.lengths[row]
        if not 0 <= start < end <= n:
            raise ValueError(f"cannot evict tokens {start}:{end} of a row holding {n}")
        cols = self.attn[row].nonzero().squeeze(1).cpu()  # the row's real columns, in order, on the host
        after = cols[end:]
        if after.numel():
            rows = torch.full_like(after, row)
            shift = torch.full(after.shape, float(start - end))
            self._shift_keys(rows, after, shift)
        self.attn[row, cols[start:end]] = 0
        self.lengths[row] = n - (end - start)

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


def _common_prefix(rows: list[list[int]]) -> list[int]:
    first, n = rows[0], len(rows[0])
    for r in rows[1:]:
        n = min(n, len(r))
        for j in range(n):
            if r[j] != first[j]:
                n = j
                break
    return first[:n]
