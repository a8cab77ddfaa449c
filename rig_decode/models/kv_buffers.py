"""KV buffers: cache layers whose keys and values are the first rows and columns of a larger buffer.

A plain ``DynamicCache`` concatenates on every write, i.e. copies (and page-faults in fresh memory
for) the whole cache every step; at 16 rows x 1,000 columns that copy was a third of the step on
CPU. A ``BufferedLayer`` writes in place while its buffer has room, keeps spare rows for rows that
join and spare columns for rows that grow, and re-lays its rows and columns in place when rows
leave or the runner compacts. ``new_cache`` builds a ``DynamicCache`` of them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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
        k, v = (like.new_zeros(cap_rows, like.shape[1], width + spare, like.shape[3]) for _ in range(2))
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

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers, spare rows and columns included (``[rows, kv_heads,
        columns, dim]``, never-written slots zero): what a compiled decode step reads and writes in
        place, with shapes that change only when the layer moves to a larger buffer."""
        self._own()
        return self._k, self._v

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
