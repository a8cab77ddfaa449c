"""Zero-prefill evidence: each evidence piece's KV is computed once, alone, and reused.

An evidence block is a concatenation of separately tokenised pieces (``EvidenceBlock.segments``:
head, per document its number and its text, tail). ``ChunkKVStore`` keeps each piece's per-layer
keys and values, computed by the model over the piece alone at positions ``0..m-1`` (a document's
text after its lead ``[1]``, so that it is one entry under any number; or after a fixed ``prefix``,
which on the default model selects worse: docs/benchmarks.md), in a least-recently-used store
bounded in bytes on the model's device, with an optional second tier in host memory. The pieces a
block lacks are computed together, in one packed forward. A piece that starts a longer one the
store holds, after the same lead (a document the evidence budget cut, once its whole text is
held), is served from that one's first columns: with causal attention a prefix's KV does not
depend on what follows it. A held piece a new one starts with is dropped, so a document is held
once. ``block_kv`` assembles a block's KV from its pieces: the keys still sit at their piece-local
positions, and ``shifts`` says how far each column is from its place in the block (the piece's
offset), so the runner moves them to their final positions with one ``rope_shift_layers_`` call
when it copies them into a row (``HFModelRunner.step(staged=)``).

What this gives up: a piece computed alone never attended to the text before it (the question, the
answer so far, earlier pieces), which exact splicing does. The tail of the block (at least its last
token, which must produce the next logits) is recomputed with full attention, as CacheBlend
recomputes a fraction of tokens to restore cross-attention; how much accuracy that costs is measured
by ``rig eval`` (docs/kernels.md).
"""

from __future__ import annotations

from collections import OrderedDict
from numbers import Integral
from typing import NamedTuple

import torch

from ..models.cache_arg import cache_kw
from ..models.kv_buffers import new_cache
from ..models.packed_attention import (PACKED_ATTENTION, PackedStep, additive_mask, attention_implementation,
                                       model_attention)
from .transfer import to_device

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, m, head_dim]
Piece = tuple[tuple[int, ...], tuple[int, ...]]  # (lead, token ids): the KV of the ids, computed after the lead


class StagedBlock(NamedTuple):
    """A block's KV assembled from its pieces (``ChunkKVStore.blocks_kv``)."""

    kv: KV  # of the block's first ``count`` tokens, keys at piece-local positions
    shifts: torch.Tensor  # per column, its distance from its place in the block (host)
    pieces: list[Piece]  # the pieces those tokens use, in order
    computed: list[Piece]  # of them, those no tier held (computed in this call), each once


def _key(piece) -> Piece:
    """A piece as the store keys it: ``(lead, ids)`` (either a tuple or a list), or token ids
    alone (no lead); at least one token."""
    if isinstance(piece, (tuple, list)) and len(piece) == 2 and isinstance(piece[0], (tuple, list)):
        lead, ids = tuple(piece[0]), tuple(piece[1])
    else:
        lead, ids = (), tuple(piece)
    if not all(isinstance(t, Integral) for t in (*lead, *ids)):
        raise TypeError(f"a piece is token ids or (lead, token ids), got {piece!r:.80}")
    if not ids:
        raise ValueError(f"a piece has at least one token, got {piece!r:.80}")
    return lead, ids


_HEAD = 4  # a piece's first tokens: the key its longer pieces are found by


def _head(key: Piece) -> tuple | None:
    return (key[0], key[1][:_HEAD]) if len(key[1]) >= _HEAD else None


def _starts(key: Piece, longer: Piece) -> bool:
    """Whether ``key``'s ids start ``longer``'s (and are fewer), after the same lead."""
    (lead, ids), (other_lead, other) = key, longer
    return lead == other_lead and len(ids) < len(other) and other[: len(ids)] == ids


def _first(kv: KV, n: int) -> KV:
    return [(k[:, :, :n], v[:, :, :n]) for k, v in kv]


def _nbytes(kv: KV) -> int:
    return sum(k.nbytes + v.nbytes for k, v in kv)


class _Tier:
    """Pieces' KV by their lead and token ids, least recently used first, bounded in bytes; the
    pieces of at least ``_HEAD`` tokens are also found by their first ones (``holding``)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.items: OrderedDict[Piece, KV] = OrderedDict()
        self.num_bytes = 0
        self.by_head: dict[tuple, set[Piece]] = {}

    def get(self, key: Piece) -> KV | None:
        kv = self.items.get(key)
        if kv is not None:
            self.items.move_to_end(key)
        return kv

    def holding(self, key: Piece) -> Piece | None:
        """The key the tier holds ``key``'s KV under: itself, or a longer piece it starts."""
        if key in self.items:
            return key
        return next((k for k in self.by_head.get(_head(key), ()) if _starts(key, k)), None)

    def started_by(self, key: Piece) -> list[Piece]:
        """The held pieces ``key`` is longer than and starts with (its KV holds theirs)."""
        return [k for k in self.by_head.get(_head(key), ()) if _starts(k, key)]

    def pop(self, key: Piece) -> KV:
        kv = self.items.pop(key)
        self._forget(key, kv)
        return kv

    def _forget(self, key: Piece, kv: KV) -> None:
        self.num_bytes -= _nbytes(kv)
        if (head := _head(key)) is not None:
            self.by_head[head].discard(key)
            if not self.by_head[head]:
                del self.by_head[head]

    def put(self, key: Piece, kv: KV) -> list[tuple[Piece, KV]]:
        """Keep ``kv``, when it fits at all; what this pushes out (or ``kv`` itself, when it does
        not fit), least recently used first."""
        size = _nbytes(kv)
        if size > self.max_bytes:
            return [(key, kv)]
        self.items[key] = kv
        self.num_bytes += size
        if (head := _head(key)) is not None:
            self.by_head.setdefault(head, set()).add(key)
        out = []
        while self.num_bytes > self.max_bytes:
            old_key, old = self.items.popitem(last=False)
            self._forget(old_key, old)
            out.append((old_key, old))
        return out


class ChunkKVStore:
    """Two tiers: up to ``max_bytes`` of piece KV on the model's device, and up to ``host_bytes``
    more in host memory (pinned, for a CUDA model), where what the device tier pushes out goes. A
    hit in the host tier costs a copy to the device (queued on the stream, no sync) instead of a
    forward, and moves the piece back to the device tier. For a CPU model both tiers are host
    memory: the host tier is only more room.

    ``prefix``: token ids every piece is computed after (e.g. the chat prompt's system turn and
    the user turn's header, which every prompt starts with), at positions ``len(prefix)..``; only
    the piece's own KV is kept, and the prefix's KV once, outside the bounds. Without one (the
    engine's way) a piece is computed alone, its first token at position 0.

    A piece can also have a ``lead`` of its own: tokens it is computed after (after the prefix),
    whose KV is not kept; the piece is stored under its lead and its ids. The evidence formatter
    gives a document's text the lead ``[1]``: the text is computed as it would be under number 1
    and reused under any number (``EvidenceBlock.leads``)."""

    def __init__(self, model, max_bytes: int = 256 << 20, prefix: list[int] | None = None, host_bytes: int = 0):
        if max_bytes < 0 or host_bytes < 0:
            raise ValueError(f"max_bytes and host_bytes must be >= 0, got {max_bytes} and {host_bytes}")
        self.model, self.max_bytes, self.host_bytes = model, max_bytes, host_bytes
        self.device = next(model.parameters()).device
        self.prefix = list(prefix or [])
        self._prefix_kv: KV | None = None
        self._device_tier, self._host_tier = _Tier(max_bytes), _Tier(host_bytes)
        self.hits = self.misses = 0
        self.host_hits = 0  # of ``hits``: those served from the host tier
        self.prefix_hits = 0  # of ``hits``: those served from a longer piece's first columns

    def __len__(self) -> int:
        return len(self._device_tier.items) + len(self._host_tier.items)

    def __contains__(self, piece: Piece | list[int]) -> bool:
        """Whether either tier holds the piece's KV, alone or as the start of a longer piece
        (without counting a hit or touching its recency)."""
        key = _key(piece)
        return any(tier.holding(key) is not None for tier in (self._device_tier, self._host_tier))

    @property
    def num_bytes(self) -> int:
        """Bytes held on the device (``host_num_bytes``: in the host tier)."""
        return self._device_tier.num_bytes

    @property
    def host_num_bytes(self) -> int:
        return self._host_tier.num_bytes

    def get(self, ids: list[int], lead: list[int] = ()) -> KV:
        """The piece's KV at positions ``p..p+len(ids)-1``, ``p`` the length of the prefix and the
        lead, computed on a miss."""
        return self.get_many([(tuple(lead), ids)])[0]

    def get_many(self, pieces: list[Piece | list[int]]) -> list[KV]:
        """Each piece's KV on the model's device (as ``get``); the pieces neither tier holds are
        computed together, in one forward (``_compute``), then stored; one that starts another of
        them is that one's first columns."""
        return self._fetch([_key(piece) for piece in pieces])[0]

    @torch.no_grad()
    def _fetch(self, keys: list[Piece]) -> tuple[list[KV], set[Piece]]:
        """``get_many`` of these keys, and the keys neither tier held (computed here)."""
        found: dict[Piece, KV] = {}
        missing: list[Piece] = []
        for key in keys:
            if key in found or key in missing:
                self.hits += 1
            elif (kv := self._held(key)) is not None:
                found[key] = kv
                self.hits += 1
            else:
                missing.append(key)
                self.misses += 1
        computed = [key for key in missing if not any(_starts(key, other) for other in missing)]
        for key, kv in zip(computed, self._compute(computed) if computed else []):
            found[key] = kv
            self._keep(key, kv)
        for key in missing:
            if key not in found:
                found[key] = _first(found[next(other for other in computed if _starts(key, other))], len(key[1]))
        return [found[key] for key in keys], set(missing)

    def _held(self, key: Piece) -> KV | None:
        """The piece's KV on the device, if either tier holds it (or a longer piece it starts: that
        one's first columns). A host tier hit is copied over and goes back to the device tier (when
        it fits there)."""
        if (held := self._device_tier.holding(key)) is not None:
            kv = self._device_tier.get(held)
        elif (held := self._host_tier.holding(key)) is not None:
            host = self._host_tier.get(held)
            kv = [(to_device(k, self.device), to_device(v, self.device)) for k, v in host]
            if _nbytes(host) <= self.max_bytes:
                self._host_tier.pop(held)
                self._keep(held, kv)
            self.host_hits += 1
        else:
            return None
        if held == key:
            return kv
        self.prefix_hits += 1
        return _first(kv, len(key[1]))

    def _keep(self, key: Piece, kv: KV) -> None:
        """Store a piece's device KV; what the device tier pushes out goes to the host tier (what
        that one pushes out is dropped). First the held pieces it starts with go, from the tier it
        will be held in and any slower one (its KV holds theirs), so they push out nothing."""
        size = _nbytes(kv)
        if size <= self.max_bytes:
            tiers = (self._device_tier, self._host_tier)
        else:
            tiers = (self._host_tier,) if size <= self.host_bytes else ()
        for tier in tiers:
            for shorter in tier.started_by(key):
                tier.pop(shorter)
        for old_key, old in self._device_tier.put(key, kv):
            if _nbytes(old) <= self.host_bytes:
                self._host_tier.put(old_key, [(self._to_host(k), self._to_host(v)) for k, v in old])

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t``: for CUDA, in pinned memory, queued on the stream (no sync: the
        copy back to the device is queued after it on the same stream)."""
        if t.device.type != "cuda":
            return t
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def _compute(self, pieces: list[Piece]) -> list[KV]:
        """The pieces' KV, each after the prefix and its lead only, from one forward: lead and
        piece after lead and piece in a single sequence, each at positions ``len(prefix)..`` and
        attending to the prefix and to its own lead and tokens up to itself (a block-diagonal
        causal mask, the runner's packed attention); no padding is computed."""
        p = len(self.prefix)
        cache = self._prefix_cache()
        fed = [[*lead, *ids] for lead, ids in pieces]
        if len(fed) == 1:
            self._forward(fed[0], cache)
        else:
            lengths = torch.tensor([len(ids) for ids in fed])
            piece_of = torch.repeat_interleave(torch.arange(len(pieces)), lengths)
            local = torch.cat([torch.arange(n) for n in lengths.tolist()])
            # token j sees the prefix, and token c of its own piece where c comes at or before j
            own = (piece_of[:, None] == piece_of[None, :]) & (local[None, :] <= local[:, None])
            mask = torch.cat([torch.ones(len(local), p, dtype=torch.bool), own], dim=1)[None, None]
            attend, additive = model_attention(self.model)
            if additive:
                mask = additive_mask(mask, self.model.dtype)
            plan = PackedStep(attend, 1, None, None, None, [(0, 0, len(local), to_device(mask, self.device))])
            with attention_implementation(self.model.config, PACKED_ATTENTION):
                self.model(input_ids=to_device(torch.tensor([[t for ids in fed for t in ids]]), self.device),
                           position_ids=to_device((local + p)[None], self.device), **cache_kw(cache), use_cache=True,
                           rig_packed=plan, logits_to_keep=1)
        out, at = [], p
        for lead, ids in pieces:
            a, b = at + len(lead), at + len(lead) + len(ids)
            out.append([(layer.keys[:, :, a:b].clone(), layer.values[:, :, a:b].clone()) for layer in cache.layers])
            at = b
        return out

    def _prefix_cache(self):
        """A cache holding the prefix's KV (computed once), to compute pieces after."""
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
                   **cache_kw(cache), use_cache=True, logits_to_keep=1)
        return cache

    def block_kv(self, token_ids: list[int], segments: list[int], count: int,
                 leads: list[list[int]] | None = None) -> tuple[KV, torch.Tensor]:
        """KV of the block's first ``count`` tokens from its pieces (``leads``: each piece's lead,
        or none), and each column's shift to its place in the block, on the host (the runner adds
        the row's length there, without a device sync). A piece cut by ``count`` contributes its
        first tokens: with causal attention a prefix's KV does not depend on what follows it."""
        block = self.blocks_kv([(token_ids, segments, count, leads)])[0]
        return block.kv, block.shifts

    def blocks_kv(self, blocks: list[tuple]) -> list[StagedBlock]:
        """``block_kv`` of each ``(token_ids, segments, count[, leads])``, with the pieces it uses
        and those of them no tier held; the pieces any of them lacks are computed together, in one
        forward (rows splicing in the same step share it)."""
        used = [self._pieces(*block) for block in blocks]
        kvs, missing = self._fetch([piece for pieces in used for piece, _, _ in pieces])
        kvs = iter(kvs)
        out = []
        for pieces in used:
            parts = [_first(next(kvs), take) for _, _, take in pieces]
            shifts = [torch.full((take,), float(a - len(self.prefix) - len(lead))) for (lead, _), a, take in pieces]
            layers = [(torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
                      for i in range(len(parts[0]))]
            keys = [piece for piece, _, _ in pieces]
            computed = list(dict.fromkeys(key for key in keys if key in missing))
            out.append(StagedBlock(layers, torch.cat(shifts), keys, computed))
        return out

    @classmethod
    def pieces(cls, token_ids: list[int], segments: list[int], count: int,
               leads: list[list[int]] | None = None) -> list[Piece]:
        """The pieces the block's first ``count`` tokens use (whole pieces), as the store keys them."""
        return [piece for piece, _, _ in cls._pieces(token_ids, segments, count, leads)]

    @staticmethod
    def _pieces(token_ids: list[int], segments: list[int], count: int,
                leads: list[list[int]] | None = None) -> list[tuple[Piece, int, int]]:
        """(piece, its first token in the block, tokens taken) of each piece the block's first
        ``count`` tokens use."""
        if sum(segments) != len(token_ids) or min(segments, default=0) < 0:
            raise ValueError(f"segments {segments} must be lengths covering the block's {len(token_ids)} tokens")
        if not 0 < count <= len(token_ids):
            raise ValueError(f"count must be in 1..{len(token_ids)}, got {count}")
        if leads and len(leads) != len(segments):
            raise ValueError(f"{len(leads)} leads for {len(segments)} segments")
        used, at = [], 0
        for i, n in enumerate(segments):
            if at >= count:
                break
            if n:  # an empty piece is skipped
                lead = tuple(leads[i]) if leads else ()
                used.append(((lead, tuple(token_ids[at : at + n])), at, min(n, count - at)))
            at += n
        return used


def value_deviation(reused: torch.Tensor, in_context: torch.Tensor) -> torch.Tensor:
    """Per token, how far reused values are from the same tokens' values computed in context:
    relative squared L2 over heads and head dims, in fp32. Tensors are ``[..., tokens, head_dim]``
    with the same shape (e.g. ``[kv_heads, n, head_dim]``); the result is ``[tokens]``. CacheBlend
    recomputes the tokens this ranks first (``KVSurgery.choose_deviating``)."""
    reused, in_context = reused.float(), in_context.float()
    dims = [d for d in range(in_context.dim()) if d != in_context.dim() - 2]
    return ((reused - in_context) ** 2).sum(dim=dims) / (in_context**2).sum(dim=dims).clamp_min(1e-12)
