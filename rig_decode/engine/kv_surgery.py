"""KV surgery: the runner's operations that put keys at positions they were not computed at.

* Staged KV (``step(..., staged=)``, zero-prefill evidence, ``kernels/chunk_kv.py``): a row's first
  pending token (the marker's last) is fed, then the staged columns are copied in with their keys
  rotated to the positions that follow, then its remaining pending tokens are fed after them.
  Nothing of the staged tokens goes through the model, unless ``reselect`` asks for CacheBlend's
  selective recompute: the staged tokens whose KV deviates most from their in-context KV
  (``choose_deviating``) are recomputed in place, at their own columns, by the runner.
* Eviction (``evict``): a span of a row's tokens becomes holes and the keys after it are rotated
  back by the span's length, so the row's positions stay contiguous and the next token sits right
  after the last kept one. Tokens after the span keep what they computed while attending to it:
  eviction is an approximation, used by ``append_format: summary``.

``KVSurgery`` works on the runner's ``RowCache`` (cache, mask and row bookkeeping) and never runs
the model: the runner (``engine/runner_hf.py``) holds it, runs the forwards around it (the fed
tokens, CacheBlend's probe and recompute) and calls it for the moves in between.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..kernels import RopeSpec, rope_of, rope_shift_layers_
from ..kernels.chunk_kv import value_deviation
from ..kernels.rope import decoder_of
from .row_cache import RowCache


class ProbeDone(Exception):
    """Stops a forward after the layers a probe needs (``stop_after``)."""


@contextmanager
def stop_after(layers, n: int):
    """A forward inside stops (``ProbeDone``) before decoder layer ``n`` (runs them all if fewer)."""
    def stop(module, args):
        raise ProbeDone

    hook = layers[n].register_forward_pre_hook(stop) if len(layers) > n else None
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()


class KVSurgery:
    PROBE_LAYERS = 2  # layers a CacheBlend probe runs: layer 1 is the first whose KV depends on the context

    def __init__(self, model, kv: RowCache):
        self.model, self.kv = model, kv
        self._rope: RopeSpec | None = None  # how the model rotates its keys, on first use

    @torch.no_grad()
    def evict(self, row: int, start: int, end: int) -> None:
        """Drop the row's cached tokens ``start:end`` (counting its real tokens) and move the keys
        after them back by ``end - start`` positions."""
        kv = self.kv
        if not isinstance(row, int) or not 0 <= row < kv.batch_size:
            raise ValueError(f"cannot evict from row {row}: the batch has rows 0..{kv.batch_size - 1}")
        n = kv.lengths[row]
        if not 0 <= start < end <= n:
            raise ValueError(f"cannot evict tokens {start}:{end} of a row holding {n}")
        cols = kv.attn[row].nonzero().squeeze(1).cpu()  # the row's real columns, in order, on the host
        after = cols[end:]
        if after.numel():
            rows = torch.full_like(after, row)
            shift = torch.full(after.shape, float(start - end))
            self._shift_keys(rows, after, shift)
        kv.attn[row, cols[start:end]] = 0
        kv.lengths[row] = n - (end - start)

    def rope(self) -> RopeSpec:
        """How the model rotates its keys (``kernels.rope_of``, checked once), its ``inv_freq`` on the device."""
        if self._rope is None:
            spec = rope_of(self.model)
            self._rope = spec._replace(inv_freq=spec.inv_freq.to(self.kv.device))
        return self._rope

    def _shift_keys(self, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor) -> None:
        """Rotate the cached keys at ``(rows[n], cols[n])`` by ``shift[n]`` positions, in every layer
        that encodes positions in its keys (a NoPE layer's keys move as they are)."""
        rope = self.rope()
        rope_shift_layers_([self.kv.cache.layers[i].keys for i in rope.layers], rows, cols, shift, rope.inv_freq,
                           rope.interleaved)

    def decoder_layers(self):
        layers = getattr(decoder_of(self.model), "layers", None)
        if layers is None:
            raise ValueError(f"{type(self.model).__name__} has no model.layers: CacheBlend's probe cannot stop "
                             "its forward at layer 2")
        return layers

    def check_staged(self, row: int, kv: list, shift: torch.Tensor, rows: list[list[int]]) -> int:
        """The number of tokens row ``row`` stages, once its KV and shifts fit the cache and the
        tokens it feeds (checked before anything is fed or written)."""
        layers = self.kv.cache.layers
        if not 0 <= row < self.kv.batch_size:
            raise ValueError(f"staged row {row} is not in the batch of {self.kv.batch_size}")
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

    def choose_deviating(self, staged, widths: dict[int, int], reselect: dict[int, int],
                         at: dict[int, tuple[int, int]]) -> dict[int, list[int]]:
        """Per row, the ``reselect[i]`` staged tokens (indices into its block, sorted) whose layer-1
        values, just computed in context by a probe forward at columns from ``at[i][0]``, differ
        most from the staged ones (CacheBlend's selection)."""
        probed = min(1, len(self.kv.cache.layers) - 1)
        fresh = self.kv.cache.layers[probed].values
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
        return chosen

    def append_staged(self, staged, widths: dict[int, int], at: dict[int, tuple[int, int]] | None = None) -> None:
        """Copy staged KV into each staged row's next columns, keys rotated from piece-local
        positions to the row's next positions; or, with ``at`` (row -> first column and position),
        over columns the row already holds."""
        cache = self.kv
        widths = {i: widths[i] for i in staged}
        rows_idx, cols_idx, shift = [], [], []
        for i, (_, local) in staged.items():
            n = widths[i]
            end, length = at[i] if at else (cache.ends[i], cache.lengths[i])
            rows_idx.append(torch.full((n,), i, dtype=torch.long))
            cols_idx.append(torch.arange(end, end + n))
            shift.append(local.float().cpu() + length)  # ChunkKVStore's shifts are on the host already
        # rope_shift_layers_ bounds-checks host indices without a device sync; layer.write needs them on the device.
        rows_idx, cols_idx, shift = torch.cat(rows_idx), torch.cat(cols_idx), torch.cat(shift)
        rows_dev, cols_dev = cache.upload(rows_idx), cache.upload(cols_idx)
        width = cache.num_columns if at else max(cache.num_columns, *(cache.ends[i] + n for i, n in widths.items()))
        for li, layer in enumerate(cache.cache.layers):
            keys, values = ([row_kv[li][part][0].transpose(0, 1) for row_kv, _ in staged.values()] for part in (0, 1))
            layer.write(rows_dev, cols_dev, torch.cat(keys).to(cache.device), torch.cat(values).to(cache.device), width)
        if not at:
            cache.mark_written(widths, width)
        self._shift_keys(rows_idx, cols_idx, shift)
