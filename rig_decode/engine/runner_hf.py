"""Batched forward passes over one HuggingFace ``DynamicCache`` with ragged rows.

Every step each row feeds the tokens it has pending: one sampled token when decoding, or the
marker-completing token plus a whole evidence block after a hop (a prefill at an offset, never one
token per step). Rows are left-padded to the longest pending list, so every row's last real token
sits in the last column and one ``logits_to_keep=1`` head call serves all of them.

Padding leaves holes in the cache columns. The runner keeps a 2-D attention mask over all columns
(0 for holes) and passes explicit per-row ``position_ids`` that count real tokens only, so each row
computes exactly what it would compute alone: that is the splice == re-prefill invariant. While no
row has a hole the mask is dropped and attention takes its plain causal path.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class HFModelRunner:
    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.attn: torch.Tensor | None = None  # [B, columns], 1 = real token
        self.lengths: list[int] = []  # real tokens each row has in the cache
        self.has_holes = False

    @property
    def context_limit(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.attn = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = [0] * batch_size
        self.has_holes = False

    @torch.no_grad()
    def step(self, rows: list[list[int]]) -> torch.Tensor:
        """Feed each row its tokens; returns fp32 logits ``[B, vocab]`` after each row's last one."""
        assert self.cache is not None and len(rows) == len(self.lengths), "reset() the runner first"
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros((len(rows), width), dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n, start = len(r), self.lengths[i]
            if n:
                ids[i, width - n :] = torch.tensor(r, dtype=torch.long)
                new_mask[i, width - n :] = 1
                pos[i, width - n :] = torch.arange(start, start + n)
            pos[i, : width - n] = start  # holes: any in-range position, they are masked out
            self.lengths[i] += n
        self.has_holes = self.has_holes or any(len(r) != width for r in rows)
        self.attn = torch.cat([self.attn, new_mask.to(self.device)], dim=1)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=self.attn if self.has_holes else None,
            position_ids=pos.to(self.device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
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
