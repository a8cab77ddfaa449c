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

import sys
from typing import NamedTuple

import torch


def rope_shift_ref_(keys: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                    inv_freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``keys[rows[n], :, cols[n], :]`` by ``shift[n]`` positions, in place.

    ``keys``: ``[batch, num_kv_heads, columns, head_dim]`` (any strides); ``rows``, ``cols``: int64
    ``[N]``; ``shift``: ``[N]`` (positions to add, negative moves back); ``inv_freq``: fp32
    ``[head_dim // 2]``; ``interleaved``: the pairs are ``(2i, 2i + 1)``, not ``(i, i + d/2)``.
    Returns ``keys``.
    """
    _check(keys, rows, cols, shift, inv_freq)
    return _rotate_(keys, rows, cols, shift, inv_freq, interleaved)


def _rotate_(keys, rows, cols, shift, inv_freq, interleaved: bool = False) -> torch.Tensor:
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


def _check(keys, rows, cols, shift, inv_freq) -> None:
    if keys.dim() != 4:
        raise ValueError(f"keys must be [batch, heads, columns, head_dim], got shape {tuple(keys.shape)}")
    if keys.shape[-1] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {keys.shape[-1]}")
    if inv_freq.numel() != keys.shape[-1] // 2:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries; head_dim {keys.shape[-1]} needs "
                         f"{keys.shape[-1] // 2}")
    if not (rows.shape == cols.shape == shift.shape) or rows.dim() != 1:
        raise ValueError(f"rows, cols and shift must be 1-D of one length, got {tuple(rows.shape)}, "
                         f"{tuple(cols.shape)}, {tuple(shift.shape)}")
    # One device sync for indices on CUDA; none on the host.
    outside = ((rows < 0) | (rows >= keys.shape[0])).any() | ((cols < 0) | (cols >= keys.shape[2])).any()
    if bool(outside):
        raise IndexError(f"a (row, column) index is outside keys of shape {tuple(keys.shape)}")


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


def rope_layers(model) -> list[int]:
    """The decoder layers whose keys carry their position: every layer but those whose attention
    skips RoPE (``self_attn.use_rope`` false: the NoPE layers of SmolLM3, Llama 4, Mistral Large 4).
    A NoPE layer's cached keys hold no position, so they move to other columns as they are."""
    layers = getattr(decoder_of(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers (model.layers): which of its "
                         "keys carry a rotation cannot be told, so its keys are not moved")
    return [i for i, layer in enumerate(layers) if getattr(getattr(layer, "self_attn", None), "use_rope", True)]


class RopeSpec(NamedTuple):
    """How a model rotates its cached keys, as the kernels take it."""

    inv_freq: torch.Tensor  # fp32 [head_dim // 2]
    interleaved: bool  # pairs (2i, 2i + 1) (Cohere, Helium), else (i, i + head_dim/2)
    layers: list[int]  # the decoder layers whose keys carry a rotation (``rope_layers``)


def rope_of(model) -> RopeSpec:
    """How a HF decoder's rotary embedding (``decoder_of(model).rotary_emb``) rotates its keys, once
    it is known to be a rotation the kernels can move.

    Re-rotation applies the pure rotation: a rope type whose ``attention_scaling`` is not 1 (YaRN)
    scales keys once when they are computed, which a later rotation must not repeat. Refused: rope
    types whose frequencies change with the sequence length ("dynamic", "longrope"), a rotary
    embedding that covers part of the head, and one that pairs dimensions in neither layout
    (``_layout``).
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
    return RopeSpec(inv_freq, _layout(decoder, rotary, inv_freq), rope_layers(model))


def rotary_inv_freq(model) -> torch.Tensor:
    """``rope_of(model).inv_freq``: the model's fp32 ``inv_freq``, once its keys are known to be movable."""
    return rope_of(model).inv_freq


def _layout(decoder, rotary, inv_freq: torch.Tensor, p: int = 3, s: int = 57) -> bool:
    """Whether the model pairs dimensions ``(2i, 2i + 1)`` (True) or ``(i, i + d/2)`` (False), found
    by running one key through its own rotary code (``apply_rotary_pos_emb`` of its modeling module)
    at positions ``p`` and ``p + s``: the first, shifted by ``s`` in that layout here, must equal the
    second. A model matching neither is refused."""
    module = sys.modules.get(type(decoder).__module__)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        raise ValueError(f"{type(decoder).__module__} has no apply_rotary_pos_emb: the layout of "
                         f"{type(decoder).__name__}'s rotary embedding cannot be checked, so its keys are not moved")
    d = 2 * inv_freq.numel()
    key = torch.randn(1, 1, 1, d, generator=torch.Generator().manual_seed(0)).to(inv_freq.device).expand(1, 1, 2, d)
    try:
        cos, sin = rotary(key, torch.tensor([[p, p + s]], device=inv_freq.device))
        rotated, _ = apply(key, key, cos, sin)
    except Exception as e:  # a rotary embedding of another signature (e.g. multimodal positions)
        raise ValueError(f"{type(rotary).__name__} could not be probed for its layout ({type(e).__name__}: {e}): "
                         "its keys are not moved") from None
    zero = torch.zeros(1, dtype=torch.long, device=inv_freq.device)  # row 0, column 0: the key at p
    for interleaved in (False, True):
        moved = rope_shift_ref_(rotated[:, :, :1].float().clone(), zero, zero, zero.float() + s, inv_freq, interleaved)
        if torch.allclose(moved, rotated[:, :, 1:].float(), atol=1e-3, rtol=1e-3):
            return interleaved
    raise ValueError(f"{type(decoder).__name__} rotates other pairs of key dimensions than (i, i + head_dim/2) or "
                     "(2i, 2i + 1), the layouts KV re-rotation moves: its keys are not moved")
