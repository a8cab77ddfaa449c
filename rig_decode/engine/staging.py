"""KV surgery: the runner's operations that put keys at positions they were not computed at.

* Staged KV (``step(..., staged=)``, zero-prefill evidence, ``kernels/chunk_kv.py``): a row's first
  pending token (the marker's last) is fed, then the staged columns are copied in with their keys
  rotated to the positions that follow, then its remaining pending tokens are fed after them.
  Nothing of the staged tokens goes through the model, unless ``reselect`` asks for CacheBlend's
  selective recompute (``_select_deviating``): the staged tokens that deviate most from their
  in-context KV are recomputed in place, at their own columns.
* Eviction (``evict``): a span of a row's tokens becomes holes and the keys after it are rotated
  back by the span's length, so the row's positions stay contiguous and the next token sits right
  after the last kept one. Tokens after the span keep what they computed while attending to it:
  eviction is an approximation, used by ``append_format: summary``.

``KVSurgery`` is a part of ``HFModelRunner`` (``engine/runner_hf.py``), whose cache, mask and
row bookkeeping it works on.
"""

from __future__ import annotations

import torch

from ..kernels import RopeSpec, rope_of, rope_shift_layers_
from ..kernels.chunk_kv import value_deviation
from ..kernels.rope import decoder_of


class _ProbeDone(Exception):
    """Stops a forward after the layers a probe needs (``HFModelRunner._select_deviating``)."""


def _stop_probe(module, args):
    raise _ProbeDone


class KVSurgery:
    PROBE_LAYERS = 2  # layers a CacheBlend probe runs: layer 1 is the first whose KV depends on the context

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
