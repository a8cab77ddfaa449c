"""RoPE re-rotation of cached keys: the plain-torch reference (the CPU path).

A key cached at position ``p`` holds ``R(p) k`` where ``R`` rotates pairs of its dimensions by
``p * inv_freq[i]``: the pairs ``(k[i], k[i + d/2])`` (the ``rotate_half`` layout of HF Llama, Qwen2,
Mistral...) or, ``interleaved``, ``(k[2i], k[2i + 1])`` (Cohere, Helium). Rotations add,
so ``R(s) R(p) k = R(p + s) k``: moving a cached key to another position is one more rotation by the
shift ``s``, with no need for the token's hidden state. Two hop-time operations are built on it:

* eviction: drop a span of ``n`` tokens and shift every key after it by ``-n``
  (``HFModelRunner.evict``, ``append_format: summary``);
* zero-prefill splice: an evidence chunk's KV computed once at positions ``0..m-1`` is copied into
  a sequence's cache at positions ``L..L+m-1`` by shifting its keys by ``L`` (``kernels/chunk_kv``).

Values carry no position and are moved as they are. The angle is computed in fp32 whatever the cache
dtype (bf16 keys are rotated in fp32 and rounded once). ``rope_of`` says how a HF model rotates its
keys (frequencies, layout, which layers), once it has checked that the kernels can move them.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..models.cache_arg import cache_kw


def rope_shift_ref_(keys: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                    inv_freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``keys[rows[n], :, cols[n], :]`` by ``shift[n]`` positions, in place.

    ``keys``: ``[batch, num_kv_heads, columns, head_dim]`` (any strides); ``rows``, ``cols``: int64
    ``[N]``; ``shift``: ``[N]`` (positions to add, negative moves back); ``inv_freq``: fp32
    ``[head_dim // 2]``; ``interleaved``: the pairs are ``(2i, 2i + 1)``, not ``(i, i + d/2)``.
    Returns ``keys``.
    """
    check_shift_args([keys], rows, cols, shift, inv_freq)
    return rotate_unchecked_(keys, rows, cols, shift, inv_freq, interleaved)


def rotate_unchecked_(keys, rows, cols, shift, inv_freq, interleaved: bool = False) -> torch.Tensor:
    """``rope_shift_ref_`` without the checks (made once by the caller)."""
    if rows.numel() == 0:
        return keys
    half = keys.shape[-1] // 2
    angle = shift.to(keys.device, torch.float32)[:, None] * inv_freq.to(keys.device, torch.float32)[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [N, 1, half]: broadcast over heads
    k = keys[rows, :, cols, :].to(torch.float32)  # [N, H, D] (advanced indexing copies)
    k1, k2 = (k[..., 0::2], k[..., 1::2]) if interleaved else (k[..., :half], k[..., half:])  # [N, H, half]
    a, b = k1 * cos - k2 * sin, k2 * cos + k1 * sin
    out = torch.stack([a, b], dim=-1).flatten(-2) if interleaved else torch.cat([a, b], dim=-1)
    keys[rows, :, cols, :] = out.to(keys.dtype)
    return keys


KEY_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_shift_args(layers: list[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                     inv_freq: torch.Tensor) -> None:
    """Every argument of a re-rotation of ``layers`` checked, before anything is written; the
    errors every backend raises (the native op checks again, as a backstop for direct calls). One
    device sync for indices on CUDA, none on the host."""
    if rows.dim() != 1 or not (rows.shape == cols.shape == shift.shape):
        raise ValueError(f"rows, cols and shift must be 1-D of one length, got {tuple(rows.shape)}, "
                         f"{tuple(cols.shape)}, {tuple(shift.shape)}")
    if rows.dtype != torch.int64 or cols.dtype != torch.int64:
        raise TypeError(f"rows and cols must be int64, got {rows.dtype} and {cols.dtype}")
    if shift.is_complex() or shift.dtype == torch.bool:
        raise TypeError(f"shift must be a real number type, got {shift.dtype}")
    if not inv_freq.is_floating_point():
        raise TypeError(f"inv_freq must be floating point, got {inv_freq.dtype}")
    if not layers:
        return
    keys = layers[0]
    if keys.dim() != 4:
        raise ValueError(f"keys must be [batch, heads, columns, head_dim], got shape {tuple(keys.shape)}")
    if keys.dtype not in KEY_DTYPES:
        raise TypeError(f"keys must be float32, float64, bfloat16 or float16, got {keys.dtype}")
    if keys.shape[-1] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {keys.shape[-1]}")
    if inv_freq.numel() != keys.shape[-1] // 2:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries; head_dim {keys.shape[-1]} needs "
                         f"{keys.shape[-1] // 2}")
    _check_layers(layers)
    outside = (rows < 0) | (rows >= keys.shape[0]) | (cols < 0) | (cols >= keys.shape[2])
    if bool(outside.any()):  # the sync, for indices on CUDA
        n = int(outside.nonzero()[0])
        raise IndexError(f"(row, column) index ({int(rows[n])}, {int(cols[n])}) at position {n} is outside keys "
                         f"of shape {tuple(keys.shape)}")


def _check_layers(layers: list[torch.Tensor]) -> None:
    """Every layer's keys of one shape, dtype and device, no two sharing memory and none whose
    own elements share memory (keys listed twice, or expanded, would be rotated twice)."""
    first, spans = layers[0], []
    for keys in layers:
        if torch._debug_has_internal_overlap(keys) == 1:  # 1: certainly overlaps (2: cannot tell)
            raise ValueError(f"keys of shape {tuple(keys.shape)} and strides {keys.stride()} hold one element "
                             "at several indices (expanded?): it would be rotated more than once")
        if (keys.shape, keys.dtype, keys.device) != (first.shape, first.dtype, first.device):
            raise ValueError(f"every layer's keys must have one shape, dtype and device, got {tuple(first.shape)} "
                             f"{first.dtype} on {first.device} and {tuple(keys.shape)} {keys.dtype} on {keys.device}")
        if keys.numel():  # the first and last byte it spans
            reach = [(n - 1) * s for n, s in zip(keys.shape, keys.stride())]
            low, high = sum(r for r in reach if r < 0), sum(r for r in reach if r > 0)
            base, item = keys.data_ptr(), keys.element_size()
            spans.append((base + low * item, base + (high + 1) * item - 1))
    spans.sort()
    if any(later[0] <= earlier[1] for earlier, later in zip(spans, spans[1:])):
        raise ValueError("two layers share memory (the same keys listed twice?): they would be rotated twice")


def head_dim_of(config) -> int:
    """A HF config's attention head size: its ``head_dim``, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def decoder_of(model):
    """The decoder stack of a HF causal LM (the module holding ``layers`` and ``rotary_emb``), also
    through a PEFT wrapper (an nf4 model keeps its marker adapter unmerged)."""
    get = getattr(model, "get_decoder", None)
    return get() if callable(get) else getattr(model, "model", model)


class RopeSpec(NamedTuple):
    """How a model rotates its cached keys, as the kernels take it."""

    inv_freq: torch.Tensor  # fp32 [head_dim // 2]
    interleaved: bool  # pairs (2i, 2i + 1) (Cohere, Helium), else (i, i + head_dim/2)
    layers: list[int]  # the decoder layers whose keys carry a rotation (the others: NoPE)


_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its inv_freq, what _probe found)


def rope_of(model) -> RopeSpec:
    """How a HF decoder rotates its cached keys, once it is known to be a rotation the kernels can
    move: the frequencies of its rotary embedding (``decoder_of(model).rotary_emb``), and, found by
    running the model (``_probe``, once per model), the pair layout and the layers that rotate at all.

    Re-rotation applies the pure rotation: a rope type whose ``attention_scaling`` is not 1 (YaRN)
    scales keys once when they are computed, which a later rotation must not repeat. Refused: rope
    types whose frequencies change with the sequence length ("dynamic", "longrope"), a rotary
    embedding that covers part of the head, and keys that a shift in neither layout moves.
    """
    decoder = decoder_of(model)
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} has no rotary embedding (model.rotary_emb.inv_freq): "
                         "cached keys cannot be moved")
    kind = getattr(rotary, "rope_type", "default")
    if kind not in ("default", "linear", "llama3", "yarn"):  # fixed frequencies; "dynamic" rescales
        raise ValueError(f"rope type {kind!r} is not supported by KV re-rotation")
    inv_freq = rotary.inv_freq.detach().to(torch.float32)
    config = getattr(model, "config", None)
    head_dim = head_dim_of(config) if hasattr(config, "num_attention_heads") else None
    if head_dim is not None and 2 * inv_freq.numel() != head_dim:
        raise ValueError(f"the rotary embedding covers {2 * inv_freq.numel()} of head_dim {head_dim} "
                         "(partial rotary): KV re-rotation rotates whole heads")
    known = _probed.get(model)
    if known is None or not torch.equal(known[0], inv_freq):
        known = _probed[model] = inv_freq, _probe(model, inv_freq)
    return known[1]


def _probe(model, inv_freq: torch.Tensor, p: int = 3, s: int = 997) -> RopeSpec:
    """Run one token through the model at positions ``p`` and ``p + s``. Alone, a token attends to
    itself only, so every layer's hidden state is the same at both positions and only a rotation
    can tell its two keys apart: a layer whose keys are equal carries no position (NoPE: SmolLM3's
    every fourth layer, Cohere2's global ones), and every other layer's key at ``p``, shifted by
    ``s`` here, must equal its key at ``p + s`` in one pair layout for all of them."""
    (before, dtype), (after, _) = (_cached_keys(model, position) for position in (p, p + s))
    if [k.shape for k in before] != [k.shape for k in after]:
        raise ValueError(f"{type(model).__name__} caches keys of other shapes at other positions: its keys are not moved")
    if before and before[0].shape[-1] != 2 * inv_freq.numel():
        raise ValueError(f"{type(model).__name__} caches keys of {before[0].shape[-1]} dimensions; its rotary "
                         f"embedding rotates {2 * inv_freq.numel()}: its keys are not moved")
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2  # 16-bit keys are rounded once more

    def near(a: torch.Tensor, b: torch.Tensor) -> bool:  # relative to the key's size, over all its heads
        return float((a - b).norm()) <= tol * float(b.norm())

    def shifted(k: torch.Tensor, interleaved: bool) -> torch.Tensor:  # [heads, head_dim], moved by s
        zero = torch.zeros(1, dtype=torch.long)
        return rotate_unchecked_(k[None, :, None].clone(), zero, zero, zero.float() + s, inv_freq.cpu(), interleaved)[0, :, 0]

    layers = [i for i, (a, b) in enumerate(zip(before, after)) if not near(a, b)]
    for interleaved in (False, True):
        if all(near(shifted(before[i], interleaved), after[i]) for i in layers):
            return RopeSpec(inv_freq, interleaved, layers)
    raise ValueError(f"{type(model).__name__} rotates other pairs of key dimensions than (i, i + head_dim/2) or "
                     "(2i, 2i + 1), the layouts KV re-rotation moves: its keys are not moved")


def _cached_keys(model, position: int) -> tuple[list[torch.Tensor], torch.dtype | None]:
    """Each layer's cached key (fp32 ``[heads, head_dim]`` on the host) of one token fed alone at
    ``position``, and the cache's dtype."""
    from transformers import DynamicCache  # only where a HF model is probed: the kernels need no transformers

    device = next(model.parameters()).device
    training = model.training
    model.eval()  # no dropout: the probe compares two forwards
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.ones(1, 1, dtype=torch.long, device=device),
                  position_ids=torch.tensor([[position]], device=device), **cache_kw(cache), use_cache=True, logits_to_keep=1)
    except Exception as e:  # another signature (e.g. multimodal positions), another cache
        raise ValueError(f"{type(model).__name__} could not be probed for how it rotates its keys "
                         f"({type(e).__name__}: {e}): its keys are not moved") from None
    finally:
        model.train(training)
    keys = [layer.keys[0, :, -1] for layer in cache.layers]
    return [k.float().cpu() for k in keys], keys[0].dtype if keys else None
