"""Packed attention: every fed token of a batch in one sequence ``[1, T]``, each attending over its
own cache row only.

A step whose rows feed different numbers of tokens (decode tokens, evidence blocks, new prompts)
goes through the model once as a single packed sequence. ``packed_attention`` is registered with
transformers' ``AttentionInterface`` under ``PACKED_ATTENTION``; run the model with it
(``attention_implementation``) and pass ``rig_packed=PackedStep(...)``: the one-token rows attend
as one batch over the whole cache, each longer row over a view of its own row, both through the
model's own attention function (sdpa or eager). No row's cache is copied. The engine's runner
(``engine/runner_hf.py``) and the zero-prefill piece store (``kernels/chunk_kv.py``) both step this
way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

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


def packed_plan(model, real: torch.Tensor, fed: list[int], counts: list[int], starts: list[int], cols: torch.Tensor,
                upload: Callable[[torch.Tensor], torch.Tensor], in_place: bool = False) -> PackedStep:
    """The masks of a packed step over a cache whose real columns are ``real`` (``[B, columns]``,
    the new tokens already marked): row ``fed[j]`` feeds ``counts[j]`` tokens from packed index
    ``starts[j]``, written at columns ``cols``. A one-token row sees its real columns; token ``j`` of
    a longer row sees its row's real columns up to its own. ``in_place`` (tokens recomputed among
    columns the row holds): every row as a longer one. ``upload`` puts host index tensors on the
    device."""
    attend, additive = model_attention(model)

    def mask(m: torch.Tensor) -> torch.Tensor:
        return additive_mask(m, model.dtype) if additive else m

    batch = real.shape[0]
    column = torch.arange(real.shape[1], device=real.device)
    single = 0 if in_place else 1
    singles = [(i, s) for i, n, s in zip(fed, counts, starts) if n == single]
    spans = [(i, s, n, mask((real[i] & (column <= cols[s : s + n, None]))[None, None]))
             for i, n, s in zip(fed, counts, starts) if n != single]
    if not singles:
        return PackedStep(attend, batch, None, None, None, spans)
    single_rows = [i for i, _ in singles]
    every_row = single_rows == list(range(batch))
    return PackedStep(attend, batch, upload(torch.tensor([s for _, s in singles])),
                      None if every_row else upload(torch.tensor(single_rows)), mask(real[:, None, None, :]), spans)


def model_attention(model) -> tuple[Callable, bool]:
    """The attention function the model is set to use, and whether it takes an additive float mask
    (eager) rather than a boolean one (sdpa; also what any other implementation falls back to)."""
    if model.config._attn_implementation == "eager":
        eager = getattr(importlib.import_module(type(model).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager, True
    return sdpa_attention_forward, False


def additive_mask(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive float mask eager attention takes."""
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)


@contextmanager
def attention_implementation(config, name: str):
    """Run the model with another registered attention implementation (with no mask function
    registered for it, the model builds no mask: the attention function brings its own)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
