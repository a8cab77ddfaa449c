"""The batch's KV cache and, per row, which of its columns hold that row's tokens.

One HuggingFace ``DynamicCache`` of ``models.kv_buffers.BufferedLayer``s holds every row. Each row
owns its line of columns and writes at its own next column (``ends``): its tokens sit in token
order, and the columns after its last token are its own spare room. ``attn`` (``[B, columns]``,
1 = a real token) marks the holes: leading holes of a batch's first prompts, evicted spans, the
spare columns of a row shorter than the widest. ``lengths`` counts each row's real tokens, which
is also its next position.

This is bookkeeping only: it never runs the model. The runner (``runner_hf.py``) runs the forwards
that write new columns and tells it what they wrote (``mark_written``, ``append_columns``);
``kv_surgery.py`` moves keys inside it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from ..kernels import to_device
from ..models.kv_buffers import BufferedLayer, new_cache


class RowCache:
    COMPACT_AT = 0.25  # compact once this share of the columns lies beyond the longest row's length

    def __init__(self, config, device: torch.device, max_slots: int | None = None):
        self.config, self.device, self.max_slots = config, device, max_slots
        self.cache: DynamicCache | None = None
        self.attn: torch.Tensor | None = None  # [B, columns], 1 = real token
        self.lengths: list[int] = []  # real tokens each row has in the cache
        self.ends: list[int] = []  # each row's next free column: after its last real token (or an evicted tail)

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
    def is_empty(self) -> bool:
        return self.cache is None or self.cache.get_seq_length() == 0

    @property
    def num_slots(self) -> int:
        """Token slots in use (rows x columns), holes included (``reserved_slots``: what is allocated)."""
        return self.batch_size * self.num_columns

    @property
    def reserved_slots(self) -> int:
        """Token slots the cache's buffers hold, spare rows and columns included: what memory is
        allocated (per layer; times ``kv_bytes_per_token_of(model)`` for bytes)."""
        return 0 if self.cache is None else max(layer.capacity for layer in self.cache.layers)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the cache's device, queued on the stream without waiting for the GPU's
        work (``kernels.to_device``), so a hop's second forward can be queued while its first still runs."""
        return to_device(t, self.device)

    def reset(self, batch_size: int = 0) -> None:
        self.cache = new_cache(self.config, self.max_slots)
        other = {type(layer).__name__ for layer in self.cache.layers if not isinstance(layer, BufferedLayer)}
        if other:
            raise ValueError(f"the runner serves full-attention models only; this one has {', '.join(sorted(other))} "
                             "cache layers (sliding-window or linear attention)")
        self.attn = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = [0] * batch_size
        self.ends = [0] * batch_size

    # -- rows joining -------------------------------------------------------------------------------

    def grow(self, rows: int, columns: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Add ``rows`` rows of holes, and ``columns`` hole columns at the right of every row
        (``like``: per-layer KV whose shapes and dtypes a cache with nothing in it yet takes)."""
        if rows == 0 and columns == 0:
            return
        if self.is_empty:  # nothing cached yet: no tensors to grow
            if columns:
                self._materialise(self.batch_size + rows, columns, like)
            else:
                self.attn = torch.zeros(self.batch_size + rows, 0, dtype=torch.long, device=self.device)
        else:
            for layer in self.cache.layers:
                layer.grow(rows, columns)
            self.attn = torch.nn.functional.pad(self.attn, (0, columns, 0, rows))
        self.lengths += [0] * rows
        self.ends += [0] * rows

    def _materialise(self, batch: int, columns: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.cache.layers, like):
            shape = (batch, k.shape[1], columns, k.shape[3])
            keys, values = k.new_zeros(shape), v.new_zeros(shape)
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        self.attn = torch.zeros(batch, columns, dtype=torch.long, device=self.device)

    def seed(self, first: int, counts: list[int], prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Rows ``first + j`` (new, empty) start with the first ``counts[j]`` tokens of ``prefix``."""
        for layer, (k, v) in zip(self.cache.layers, prefix):
            keys, values = layer.keys, layer.values
            for j, n in enumerate(counts):
                if n:
                    keys[first + j, :, :n] = k[0, :, :n]
                    values[first + j, :, :n] = v[0, :, :n]
        for j, n in enumerate(counts):
            if n:
                self.attn[first + j, :n] = 1
                self.lengths[first + j] = self.ends[first + j] = n

    # -- what a forward wrote -----------------------------------------------------------------------

    def mark_written(self, counts: dict[int, int], width: int) -> None:
        """Rows ``i`` now hold ``counts[i]`` more real tokens at their next columns; the cache is
        ``width`` columns wide."""
        if width > self.num_columns:
            self.attn = torch.nn.functional.pad(self.attn, (0, width - self.num_columns))
        for i, n in counts.items():
            self.attn[i, self.ends[i] : self.ends[i] + n] = 1
            self.lengths[i] += n
            self.ends[i] += n

    def append_columns(self, new_mask: torch.Tensor, fed: list[int]) -> None:
        """New right-hand columns (``new_mask``: ``[B, n]`` host, 1 = real), ``fed[i]`` real in row ``i``."""
        self.attn = torch.cat([self.attn, self.upload(new_mask)], dim=1)
        self.lengths = [n + k for n, k in zip(self.lengths, fed)]
        self.ends = [self.num_columns if k else e for e, k in zip(self.ends, fed)]

    # -- rows, tokens and holes leaving -------------------------------------------------------------

    def drop_last(self, n: int) -> None:
        """Forget every row's last ``n`` tokens, which must be its last ``n`` columns (a lone row,
        or rows that all fed the same number of tokens since): benchmarks repeat a step this way."""
        width = self.num_columns - n
        if n < 1 or width < 0 or any(e != self.num_columns for e in self.ends) or not bool(self.attn[:, width:].all()):
            raise ValueError(f"cannot drop the last {n} tokens: they are not every row's last {n} columns")
        self.truncate(width)
        self.lengths = [x - n for x in self.lengths]
        self.ends = [width] * self.batch_size

    def truncate(self, width: int) -> None:
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
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if keep and not self.is_empty:
            for layer in self.cache.layers:
                layer.select_rows(keep)
        self.attn = self.attn.index_select(0, idx)
        self.lengths = [self.lengths[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        if not keep:
            self.reset(0)
            return
        self.truncate(max(self.ends))  # the columns past every row's last token
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
