"""Batched forward passes over one HuggingFace ``DynamicCache`` with ragged rows.

Every step each row feeds the tokens it has pending: one sampled token when decoding, or the
marker-completing token plus a whole evidence block after a hop (a prefill at an offset, never one
token per step). Rows are left-padded to the longest pending list, so every row's last real token
sits in the last column and one ``logits_to_keep=1`` head call serves all of them.

Padding leaves holes in the cache columns. The runner keeps a 2-D attention mask over all columns
(0 for holes) and passes explicit per-row ``position_ids`` that count real tokens only, so each row
computes exactly what it would compute alone: that is the splice == re-prefill invariant. While no
row has a hole the mask is dropped and attention takes its plain causal path.

When some rows splice while others decode, padding every decode row to the evidence length would
multiply the step's work by the batch size. Such a step runs in two forwards instead: every row's
first pending token over the whole batch (a plain decode step), then the splicing rows' remaining
tokens over a copy of just their cache rows, whose new columns are written back (holes elsewhere).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class HFModelRunner:
    MIN_SHARED_PREFIX = 16

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.attn: torch.Tensor | None = None  # [B, columns], 1 = real token
        self.lengths: list[int] = []  # real tokens each row has in the cache
        self.has_holes = False
        self._prefix: tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    @property
    def context_limit(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.attn = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = [0] * batch_size
        self.has_holes = False

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Reset to ``len(prompts)`` rows and prefill them. The prefix all prompts share (the system
        prompt, typically) is computed once, kept for the next batch, and copied to every row."""
        self.reset(len(prompts))
        shared = _common_prefix(prompts)
        shared = shared[: min(len(p) for p in prompts) - 1]
        if len(shared) < self.MIN_SHARED_PREFIX:
            return self.step(prompts)
        if self._prefix is None or self._prefix[0] != tuple(shared):
            one = DynamicCache(config=self.model.config)
            self.model(input_ids=torch.tensor([shared], device=self.device), cache=one, use_cache=True,
                       logits_to_keep=1)
            self._prefix = (tuple(shared), [(layer.keys, layer.values) for layer in one.layers])
        batch = len(prompts)
        for layer, (k, v) in zip(self.cache.layers, self._prefix[1]):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
        self.attn = torch.ones(batch, len(shared), dtype=torch.long, device=self.device)
        self.lengths = [len(shared)] * batch
        return self.step([p[len(shared):] for p in prompts])

    @torch.no_grad()
    def step(self, rows: list[list[int]]) -> torch.Tensor:
        """Feed each row its tokens; returns fp32 logits ``[B, vocab]`` after each row's last one."""
        assert self.cache is not None and len(rows) == len(self.lengths), "reset() the runner first"
        splicing = [i for i, r in enumerate(rows) if len(r) > 1]
        if not splicing or len(splicing) == len(rows) or self.cache.get_seq_length() == 0:
            return self._forward_all(rows)
        logits = self._forward_all([r[:1] for r in rows])
        logits[splicing] = self._forward_rows(splicing, [rows[i][1:] for i in splicing])
        return logits

    def _inputs(self, rows: list[list[int]], lengths: list[int]):
        """Left-padded ids, the new mask columns and per-row positions for one forward."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, start) in enumerate(zip(rows, lengths)):
            n = len(r)
            if n:
                ids[i, width - n :] = torch.tensor(r, dtype=torch.long)
                mask[i, width - n :] = 1
                pos[i, width - n :] = torch.arange(start, start + n)
            pos[i, : width - n] = start  # holes: any in-range position, they are masked out
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    def _forward_all(self, rows: list[list[int]]) -> torch.Tensor:
        ids, new_mask, pos = self._inputs(rows, self.lengths)
        self.has_holes = self.has_holes or not bool(new_mask.all())
        self.attn = torch.cat([self.attn, new_mask], dim=1)
        self.lengths = [n + len(r) for n, r in zip(self.lengths, rows)]
        out = self.model(input_ids=ids, attention_mask=self.attn if self.has_holes else None,
                         position_ids=pos, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def _forward_rows(self, idx: list[int], rows: list[list[int]]) -> torch.Tensor:
        """Forward some rows only, over a copy of their cache; the others get hole columns."""
        index = torch.tensor(idx, dtype=torch.long, device=self.device)
        sub = DynamicCache(config=self.model.config)
        for layer, full in zip(sub.layers, self.cache.layers):
            keys, values = full.keys.index_select(0, index), full.values.index_select(0, index)
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        ids, new_mask, pos = self._inputs(rows, [self.lengths[i] for i in idx])
        out = self.model(input_ids=ids, attention_mask=torch.cat([self.attn[index], new_mask], dim=1),
                         position_ids=pos, cache=sub, use_cache=True, logits_to_keep=1)
        width = ids.shape[1]
        for layer, full in zip(sub.layers, self.cache.layers):
            for name in ("keys", "values"):
                grown = torch.nn.functional.pad(getattr(full, name), (0, 0, 0, width))
                grown[index, :, -width:] = getattr(layer, name)[:, :, -width:]
                setattr(full, name, grown)
        block = torch.zeros((len(self.lengths), width), dtype=torch.long, device=self.device)
        block[index] = new_mask
        self.attn = torch.cat([self.attn, block], dim=1)
        self.has_holes = True
        for i, r in zip(idx, rows):
            self.lengths[i] += len(r)
        return out.logits[:, -1, :].float()

    def select(self, keep: list[int]) -> None:
        """Keep only these rows (finished ones leave the batch and free their cache)."""
        if keep == list(range(len(self.lengths))):
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if keep:
            self.cache.batch_select_indices(idx)
        self.attn = self.attn.index_select(0, idx)
        self.lengths = [self.lengths[i] for i in keep]
        # Columns that are holes in every remaining row carry nothing: drop them.
        live = self.attn.any(dim=0)
        if keep and not bool(live.all()):
            cols = live.nonzero().squeeze(1)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(-2, cols)
                layer.values = layer.values.index_select(-2, cols)
            self.attn = self.attn.index_select(1, cols)
        self.has_holes = not bool(self.attn.all()) if keep else False


def _common_prefix(rows: list[list[int]]) -> list[int]:
    first, n = rows[0], len(rows[0])
    for r in rows[1:]:
        n = min(n, len(r))
        for j in range(n):
            if r[j] != first[j]:
                n = j
                break
    return first[:n]
