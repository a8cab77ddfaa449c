"""Zero-prefill evidence: each evidence piece's KV is computed once, alone, and reused.

An evidence block is a concatenation of separately tokenised pieces (``EvidenceBlock.segments``:
head, one line per document, tail). ``ChunkKVStore`` keeps each piece's per-layer keys and values,
computed by the model over the piece alone at positions ``0..m-1`` (or after a fixed ``prefix``,
which on the default model selects worse: docs/benchmarks.md), in a least-recently-used store
bounded in bytes; the pieces a block lacks are computed together, in one packed forward.
``block_kv`` assembles a block's KV from its pieces: the keys still sit at
their piece-local positions, and ``shifts`` says how far each column is from its place in the block
(the piece's offset), so the runner moves them to their final positions with one
``rope_shift_layers_`` call when it copies them into a row (``HFModelRunner.step(staged=)``).

What this gives up: a piece computed alone never attended to the text before it (the question, the
answer so far, earlier pieces), which exact splicing does. The tail of the block (at least its last
token, which must produce the next logits) is recomputed with full attention, as CacheBlend
recomputes a fraction of tokens to restore cross-attention; how much accuracy that costs is measured
by ``rig eval`` (docs/kernels.md).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import to_device

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, m, head_dim]


class ChunkKVStore:
    """``prefix``: token ids every piece is computed after (e.g. the chat prompt's system turn,
    which every row starts with), at positions ``len(prefix)..``; only the piece's own KV is kept,
    and the prefix's KV once, outside ``max_bytes``. Without one (the engine's way) a piece is
    computed alone, its first token at position 0."""

    def __init__(self, model, max_bytes: int = 256 << 20, prefix: list[int] | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.model, self.max_bytes = model, max_bytes
        self.device = next(model.parameters()).device
        self.prefix = list(prefix or [])
        self._prefix_kv: KV | None = None
        self._items: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, ids: list[int]) -> KV:
        """The piece's KV at positions ``len(prefix)..len(prefix)+len(ids)-1``, computed on a miss."""
        return self.get_many([ids])[0]

    @torch.no_grad()
    def get_many(self, pieces: list[list[int]]) -> list[KV]:
        """Each piece's KV (as ``get``); the pieces the store lacks are computed together, in one
        forward (``_compute``), then stored."""
        found: dict[tuple[int, ...], KV] = {}
        missing: list[tuple[int, ...]] = []
        for ids in pieces:
            key = tuple(ids)
            if key in found or key in missing:
                self.hits += 1
            elif (kv := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                found[key] = kv
                self.hits += 1
            else:
                missing.append(key)
                self.misses += 1
        if missing:
            for key, kv in zip(missing, self._compute([list(k) for k in missing])):
                found[key] = kv
                self._keep(key, kv)
        return [found[tuple(ids)] for ids in pieces]

    def _keep(self, key: tuple[int, ...], kv: KV) -> None:
        size = sum(k.nbytes + v.nbytes for k, v in kv)
        if size <= self.max_bytes:
            self._items[key] = kv
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.num_bytes -= sum(k.nbytes + v.nbytes for k, v in old)

    def _compute(self, pieces: list[list[int]]) -> list[KV]:
        """The pieces' KV, each after the prefix only, from one forward: the pieces go one after
        another in a single sequence, each at positions ``len(prefix)..`` and attending to the
        prefix and to its own tokens up to itself (a block-diagonal causal mask, the runner's
        packed attention); no padding is computed."""
        from ..engine.runner_hf import PACKED_ATTENTION, PackedStep, _attention_implementation, _model_attention

        p = len(self.prefix)
        cache = self._prefix_cache()
        if len(pieces) == 1:
            self._forward(pieces[0], cache)
        else:
            lengths = torch.tensor([len(ids) for ids in pieces])
            piece_of = torch.repeat_interleave(torch.arange(len(pieces)), lengths)
            local = torch.cat([torch.arange(n) for n in lengths.tolist()])
            # token j sees the prefix, and token c of its own piece where c comes at or before j
            own = (piece_of[:, None] == piece_of[None, :]) & (local[None, :] <= local[:, None])
            mask = torch.cat([torch.ones(len(local), p, dtype=torch.bool), own], dim=1)[None, None]
            attend, additive = _model_attention(self.model)
            if additive:
                dtype = self.model.dtype
                mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
            plan = PackedStep(attend, 1, None, None, None, [(0, 0, len(local), to_device(mask, self.device))])
            with _attention_implementation(self.model.config, PACKED_ATTENTION):
                self.model(input_ids=to_device(torch.tensor([[t for ids in pieces for t in ids]]), self.device),
                           position_ids=to_device((local + p)[None], self.device), cache=cache, use_cache=True,
                           rig_packed=plan, logits_to_keep=1)
        out, at = [], p
        for ids in pieces:
            out.append([(layer.keys[:, :, at : at + len(ids)].clone(), layer.values[:, :, at : at + len(ids)].clone())
                        for layer in cache.layers])
            at += len(ids)
        return out

    def _prefix_cache(self):
        """A cache holding the prefix's KV (computed once), to compute pieces after."""
        from ..engine.runner_hf import new_cache

        cache = new_cache(self.model.config)
        if not self.prefix:
            return cache
        if self._prefix_kv is None:
            self._prefix_kv = [(layer.keys.clone(), layer.values.clone())
                               for layer in self._forward(self.prefix, cache).layers]
            cache = new_cache(self.model.config)
        for layer, (k, v) in zip(cache.layers, self._prefix_kv):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v  # installed, not owned: the pieces' forward writes elsewhere
        return cache

    def _forward(self, ids: list[int], cache):
        start = cache.get_seq_length()
        self.model(input_ids=to_device(torch.tensor([ids]), self.device),
                   position_ids=to_device(torch.arange(start, start + len(ids))[None], self.device),
                   cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def block_kv(self, token_ids: list[int], segments: list[int], count: int) -> tuple[KV, torch.Tensor]:
        """KV of the block's first ``count`` tokens from its pieces, and each column's shift to its
        place in the block, on the host (the runner adds the row's length there, without a device
        sync). A piece cut by ``count`` contributes its first tokens: with causal attention a
        prefix's KV does not depend on what follows it."""
        if sum(segments) != len(token_ids) or min(segments, default=0) < 0:
            raise ValueError(f"segments {segments} must be lengths covering the block's {len(token_ids)} tokens")
        if not 0 < count <= len(token_ids):
            raise ValueError(f"count must be in 1..{len(token_ids)}, got {count}")
        used: list[tuple[int, int, int]] = []  # (first token, length, tokens taken) of each piece used
        at = 0
        for n in segments:
            if at >= count:
                break
            if n:  # an empty piece is skipped
                used.append((at, n, min(n, count - at)))
            at += n
        kvs = self.get_many([token_ids[a : a + n] for a, n, _ in used])
        parts = [[(k[:, :, :take], v[:, :, :take]) for k, v in kv] for kv, (_, _, take) in zip(kvs, used)]
        shifts = [torch.full((take,), float(a - len(self.prefix))) for a, _, take in used]
        layers = [(torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
                  for i in range(len(parts[0]))]
        return layers, torch.cat(shifts)


def value_deviation(reused: torch.Tensor, in_context: torch.Tensor) -> torch.Tensor:
    """Per token, how far reused values are from the same tokens' values computed in context:
    relative squared L2 over heads and head dims, in fp32. Tensors are ``[..., tokens, head_dim]``
    with the same shape (e.g. ``[kv_heads, n, head_dim]``); the result is ``[tokens]``. CacheBlend
    recomputes the tokens this ranks first (``HFModelRunner._select_deviating``)."""
    reused, in_context = reused.float(), in_context.float()
    dims = [d for d in range(in_context.dim()) if d != in_context.dim() - 2]
    return ((reused - in_context) ** 2).sum(dim=dims) / (in_context**2).sum(dim=dims).clamp_min(1e-12)
