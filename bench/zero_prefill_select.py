"""Which evidence tokens should zero-prefill recompute? The block's tail vs CacheBlend's selection.

Zero-prefill (``engine.zero_prefill``) copies each evidence piece's KV, computed alone, into the
cache and recomputes a share of the block with full attention: today its last tokens. CacheBlend
instead recomputes the tokens whose KV deviates most from what they would hold in context, found
at an early layer. This measures, on the real default model, how close each choice brings the
answer to the exact splice's, at equal recomputed shares.

Each case is a held-out 1-hop question of the synthetic benchmark (``rig synth``'s generator, seed
0, test world): the chat prompt, the query the model writes for it (greedy, between its markers),
then an evidence block of the gold document and three documents of the same kind, the gold one
first, as retrieval ranks it (``--gold random``: at a seeded random place). The exact splice feeds
the block through the model; every variant holds the context's exact KV, the block's pieces
computed alone (keys rotated to their positions), and recomputes the selected block tokens (always
the last) over the context and the block, each token attending by position to the stored KV of the
tokens not selected and the fresh KV of those selected (CacheBlend's semantics). Selections at a
share ``r`` of the block's tokens:

* ``tail``: the block's last tokens (what the engine does);
* ``deviation@1``: the tokens whose layer-1 values differ most from their in-context values
  (CacheBlend: layer 0's KV does not depend on the context, layer 1's is the first that does; in
  a system this costs one layer of the block's prefill, here it is read from the exact forward);
* ``deviation@all``: the same over every layer's values, an oracle no system has before computing;
* ``deviation@L`` for each ``--probe-layers`` layer ``L`` other than 1: the same at layer ``L`` (a
  system would run ``L + 1`` layers over the block to find them);
* ``deviation@L+probe`` (with ``--keep-probe-kv``): the same selection, but every block token
  keeps the KV of layers ``0..L`` the probe computed in context instead of the stored KV (a
  system's probe computes it anyway; the engine overwrites it with the stored KV).
* ``heads`` (with ``--piece-heads``): each piece's first tokens, round-robin over the pieces (a
  piece computed alone makes its first token an attention sink; EPIC recomputes the first tokens
  of each chunk for that reason);
* ``heads+deviation@L`` (with ``--piece-heads``): each piece's first token, the rest by
  ``deviation@L``.

The block's pieces are the engine's: its head, per document its number ``[n]`` and its text
(computed after ``[1]``, so that it is reused under any number), its tail. ``--doc-pieces alone``
computes a document's text alone instead, ``--doc-pieces line`` its number and text as one piece
(reused only under the same number).

``--piece-prefix system`` computes each piece after the chat prompt's system turn and the user
turn's header (which every prompt starts with) instead of alone (``ChunkKVStore(prefix=)``).

``none`` recomputes the last token only (zero-prefill with nothing else recomputed: the floor of
every selection); ``all`` recomputes every token, which must reproduce the exact splice (the
harness's own check).

Per variant: agreement of the greedy next token with the exact splice's along its continuation
(teacher-forced), the mean extra negative log-likelihood of that continuation, the share of
greedy continuations identical to the exact one, and the share containing the gold answer.

    python bench/zero_prefill_select.py [--examples 60] [--shares 0.1,0.25,0.5] [--gold first|random]
                                        [--probe-layers 1] [--keep-probe-kv] [--piece-prefix none|system]
                                        [--piece-heads] [--doc-pieces lead|alone|line]
                                        [--plot PNG]

Prints a table, then one JSON line; ``--plot`` also draws the identical answers and the extra NLL
against the share recomputed, one line per selection.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rig_decode.config import ModelConfig
from rig_decode.eval.metrics import contains_answer
from rig_decode.kernels import rope_of, rope_shift_
from rig_decode.kernels.chunk_kv import ChunkKVStore, value_deviation
from rig_decode.markers import MarkerSpec
from rig_decode.models.cache_arg import cache_kw
from rig_decode.models.kv_buffers import new_cache
from rig_decode.models.loader import load_model
from rig_decode.models.packed_attention import attention_implementation

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script (the tests load this file)
from harness import Table, emit  # noqa: E402
from zero_prefill_cases import doc_pieces, make_cases, system_turn, write_queries  # noqa: E402

MASKED = "rig_select_masked"


def _masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, rig_mask=None, **kwargs):
    """The model's sdpa attention under an explicit boolean mask ``[1, 1, queries, columns]``."""
    return sdpa_attention_forward(module, query, key, value, rig_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(MASKED, _masked_attention)


def _cache(config, kv):
    """A cache holding these per-layer keys and values."""
    cache = new_cache(config)
    for layer, (k, v) in zip(cache.layers, kv):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def _forward(model, ids, positions, cache, mask=None):
    """Logits of each fed token; ``mask``: boolean ``[queries, columns]`` over the cache with the new
    tokens appended, or None for plain causal attention."""
    kwargs = dict(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), **cache_kw(cache), use_cache=True)
    if mask is None:
        return model(**kwargs).logits[0].float()
    with attention_implementation(model.config, MASKED):
        return model(**kwargs, rig_mask=mask[None, None]).logits[0].float()


@torch.no_grad()
def run_variant(model, ctx_kv, stored_kv, block: list[int], selected: list[int], cont: list[int]):
    """(logits predicting each of ``cont``'s tokens, greedy continuation as long as ``cont``) with
    the block's ``selected`` tokens recomputed over the context and the block's stored KV."""
    c, m = ctx_kv[0][0].shape[2], len(block)
    cache = _cache(model.config, [(torch.cat([ck, sk], 2), torch.cat([cv, sv], 2))
                                  for (ck, cv), (sk, sv) in zip(ctx_kv, stored_kv)])
    sel = torch.tensor(selected)
    keep = torch.ones(c + m, dtype=torch.bool)
    keep[c + sel] = False  # stale: their fresh KV is appended
    block_col = torch.arange(m)
    stored_ok = keep[c:][None, :] & (block_col[None, :] < sel[:, None])
    fresh_ok = sel[None, :] <= sel[:, None]
    mask = torch.cat([torch.ones(len(selected), c, dtype=torch.bool), stored_ok, fresh_ok], dim=1)
    logits = _forward(model, [block[s] for s in selected], [c + s for s in selected], cache, mask)[-1:]
    keep = torch.cat([keep, torch.ones(len(selected), dtype=torch.bool)])
    width, pos = keep.numel(), c + m
    # Teacher-forced over the exact continuation (all but its last token), then dropped again.
    n = len(cont) - 1
    tf_mask = torch.cat([keep[None, :].expand(n, -1), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
    tf = _forward(model, cont[:-1], list(range(pos, pos + n)), cache, tf_mask) if n else logits[:0]
    for layer in cache.layers:
        layer.truncate(width)
    predict = torch.cat([logits, tf])
    out, nxt = [], int(logits[-1].argmax())
    for t in range(len(cont)):
        out.append(nxt)
        if t == len(cont) - 1:
            break
        keep = torch.cat([keep, torch.ones(1, dtype=torch.bool)])
        nxt = int(_forward(model, [nxt], [pos + t], cache, keep[None, :])[-1].argmax())
    return predict, out


def select(rule: str, share: float, m: int, deviation: dict[str, torch.Tensor],
           segments: list[int] = ()) -> list[int]:
    """The block tokens ``rule`` recomputes at ``share`` (always the last, which gives the logits)."""
    if rule == "none":
        return [m - 1]
    if rule == "all":
        return list(range(m))
    k = max(1, math.ceil(share * m))
    if rule == "tail":
        return list(range(m - k, m))
    if rule == "heads":  # the pieces' first tokens, then their second ones, ...
        offsets = _piece_offsets(segments, m - 1)
        order = sorted(range(m - 1), key=lambda t: (offsets[t], t))[: k - 1]
        return sorted(order + [m - 1])
    forced = []
    if rule.startswith("heads+"):  # each piece's first token, the rest by deviation
        rule = rule.removeprefix("heads+")
        forced = _piece_starts(segments, m - 1)[: k - 1]
    score = deviation[rule][: m - 1].clone()
    score[forced] = float("inf")
    order = score.argsort(descending=True)[: k - 1].tolist()
    return sorted(order + [m - 1])


def _piece_offsets(segments: list[int], m: int) -> list[int]:
    """For each of the block's first ``m`` columns, its place within its piece."""
    return [j for n in segments for j in range(n)][:m]


def _piece_starts(segments: list[int], m: int) -> list[int]:
    """The columns among the block's first ``m`` where a piece starts."""
    return [t for t, j in enumerate(_piece_offsets(segments, m)) if j == 0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=60)
    ap.add_argument("--shares", default="0.1,0.25,0.5")
    ap.add_argument("--gold", choices=("first", "random"), default="first",
                    help="where the gold document sits in the block: first (as retrieval ranks it) or anywhere")
    ap.add_argument("--probe-layers", default="1", help="layers whose value deviation selects (deviation@L)")
    ap.add_argument("--keep-probe-kv", action="store_true",
                    help="also run each deviation@L keeping the probe's in-context KV of layers 0..L "
                         "(deviation@L+probe)")
    ap.add_argument("--piece-prefix", choices=("none", "system"), default="none",
                    help="compute each evidence piece alone (none) or after what every chat prompt starts with")
    ap.add_argument("--piece-heads", action="store_true",
                    help="also recompute the pieces' first tokens (heads) and those plus deviation@1 "
                         "(heads+deviation@1)")
    ap.add_argument("--doc-pieces", choices=("lead", "alone", "line"), default="lead",
                    help="a document's text computed after [1] (lead: the engine's), alone, or in one piece "
                         "with its number (line)")
    ap.add_argument("--plot", help="also draw identical answers and extra NLL vs the share recomputed into this PNG")
    ap.add_argument("--tokens", type=int, default=24, help="longest answer generated (it ends at the end of the turn)")
    args = ap.parse_args(argv)
    shares = [float(x) for x in args.shares.split(",")]
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig())
    probe = tuple(int(x) for x in args.probe_layers.split(","))
    return report(model, tok, args.examples, shares, args.tokens, gold_first=args.gold == "first", plot_path=args.plot,
                  probe_layers=probe, keep_probe_kv=args.keep_probe_kv, piece_prefix=args.piece_prefix,
                  piece_heads=args.piece_heads, pieces=args.doc_pieces)


@torch.no_grad()
def report(model, tok, examples: int, shares: list[float], tokens: int, gold_first: bool = True,
           spec: MarkerSpec | None = None, plot_path: str | None = None, probe_layers: tuple[int, ...] = (1,),
           keep_probe_kv: bool = False, piece_prefix: str = "none", piece_heads: bool = False,
           pieces: str = "lead") -> int:
    depth = model.config.num_hidden_layers
    if any(not 0 <= L < depth for L in probe_layers):
        raise ValueError(f"--probe-layers {list(probe_layers)}: the model has layers 0..{depth - 1}")
    spec = spec or MarkerSpec.special_token()
    t0 = time.perf_counter()
    cases = make_cases(tok, examples, gold_first=gold_first)
    write_queries(model, tok, cases, spec)
    rope = rope_of(model)
    prefix = system_turn(tok, spec) if piece_prefix == "system" else None
    store = ChunkKVStore(model, max_bytes=1 << 30, prefix=prefix)
    stop = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if t not in (None, tok.unk_token_id)}
    kept = ("", "+probe") if keep_probe_kv else ("",)
    heads = ("heads", *(f"heads+deviation@{L}" for L in probe_layers)) if piece_heads else ()
    rules = ("tail", *(f"deviation@{L}{k}" for L in probe_layers for k in kept), *heads, "deviation@all")
    variants = [("none", 0.0), *((r, s) for s in shares for r in rules), ("all", 1.0)]
    stats = {v: {"agree": 0, "nll": 0.0, "same": 0, "gold": 0, "recomputed": 0} for v in variants}
    exact_gold = predicted = 0
    head_ranks: dict[int, list[int]] = {L: [] for L in probe_layers}
    for i, case in enumerate(cases):
        c, m = len(case.context), len(case.block)
        cache = new_cache(model.config)
        _forward(model, case.context, list(range(c)), cache)
        ctx_kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        # The exact splice: the block fed through the model after the context, then greedy.
        logits = _forward(model, case.block, list(range(c, c + m)), cache)[-1:]
        in_context = [(layer.keys[:, :, c:].clone(), layer.values[:, :, c:].clone()) for layer in cache.layers]
        cont, nxt = [], int(logits[-1].argmax())
        for t in range(tokens):  # the exact answer, up to the end of the turn
            cont.append(nxt)
            if nxt in stop:
                break
            nxt = int(_forward(model, [nxt], [c + m + t], cache)[-1].argmax())
        # Its logits over that continuation, teacher-forced as the variants' are.
        for layer in cache.layers:
            layer.truncate(c + m)
        n_tf = len(cont) - 1
        exact_tf = torch.cat([logits, _forward(model, cont[:-1], list(range(c + m, c + m + n_tf)), cache)
                              if n_tf else logits[:0]])
        exact_gold += contains_answer(tok.decode(cont, skip_special_tokens=True), case.answers)
        # The block's pieces computed alone, keys moved to their positions in this context.
        segments, leads = doc_pieces(case, pieces)
        kv, shift = store.block_kv(case.block, segments, m, leads)
        stored = []
        for layer, (k, v) in enumerate(kv):
            k = k.clone()
            if layer in rope.layers:  # a NoPE layer's keys carry no position
                rope_shift_(k, torch.zeros(m, dtype=torch.long), torch.arange(m), shift + c, rope.inv_freq,
                            rope.interleaved)
            stored.append((k, v))
        dev = torch.stack([value_deviation(v, ref) for (_, v), (_, ref) in zip(stored, in_context)])  # [layers, m]
        deviation = {"deviation@all": dev.sum(0), **{f"deviation@{L}": dev[L] for L in probe_layers}}
        if piece_heads:  # where the pieces' first tokens rank by deviation (0: the most deviating)
            starts = _piece_starts(segments, m - 1)
            for L in probe_layers:
                order = deviation[f"deviation@{L}"][: m - 1].argsort(descending=True).tolist()
                head_ranks[L].append(max(order.index(t) for t in starts))
        probed = {f"deviation@{L}+probe": in_context[: L + 1] + stored[L + 1 :] for L in probe_layers}
        target = torch.tensor(cont)
        ref_lp = exact_tf.log_softmax(-1)[torch.arange(len(cont)), target]
        for rule, share in variants:
            chosen = select(rule.removesuffix("+probe"), share, m, deviation, segments)
            pred, out = run_variant(model, ctx_kv, probed.get(rule, stored), case.block, chosen, cont)
            lp = pred.log_softmax(-1)[torch.arange(len(cont)), target]
            s = stats[(rule, share)]
            s["agree"] += int((pred.argmax(-1) == target).sum())
            s["nll"] += float((ref_lp - lp).sum())
            s["same"] += out == cont
            s["gold"] += contains_answer(tok.decode(out, skip_special_tokens=True), case.answers)
            s["recomputed"] += len(chosen) / m
        predicted += len(cont)
        print(f"  case {i + 1}/{len(cases)}: block {m} tokens, context {c}", file=sys.stderr, flush=True)
    n = len(cases)
    rows = {f"{r}@{s:g}": {"recomputed_pct": round(100 * st["recomputed"] / n, 1),
                           "top1_agreement_pct": round(100 * st["agree"] / predicted, 1),
                           "extra_nll_per_token": round(st["nll"] / predicted, 3),
                           "identical_pct": round(100 * st["same"] / n, 1),
                           "gold_answer_pct": round(100 * st["gold"] / n, 1)}
            for (r, s), st in stats.items()}
    print(f"{n} held-out 1-hop questions, gold document {'first' if gold_first else 'at a random place'} of "
          f"{cases[0].documents if cases else 0}; exact splice: {100 * exact_gold / n:.1f}% of answers "
          "contain the gold answer\n")
    table = Table(("recompute", "<"), ("share of block recomputed", "{:.1f}%"),
                  ("next-token agreement with exact", "{:.1f}%"), ("extra NLL / token", "{:.3f}"),
                  ("identical continuation", "{:.1f}%"), ("gold answer", "{:.1f}%"), markdown=True)
    for name, r in rows.items():
        table.add(name, r["recomputed_pct"], r["top1_agreement_pct"], r["extra_nll_per_token"], r["identical_pct"],
                  r["gold_answer_pct"])
    table.print()
    worst_head = {f"deviation@{L}": max(r) for L, r in head_ranks.items() if r}
    for rule, rank in worst_head.items():
        print(f"\n{rule} ranks every piece's first token among the block's {rank + 1} most deviating tokens "
              f"(the worst of {n} blocks of {min(len(c.block) for c in cases)}-{max(len(c.block) for c in cases)} "
              "tokens)")
    if plot_path:
        plot(rows, shares, rules, plot_path, f"{n} held-out 1-hop questions, gold document "
             f"{'first' if gold_first else 'anywhere'}; exact splice: {100 * exact_gold / n:.0f}% right")
    emit({"bench": "zero_prefill_select", "examples": n, "gold": "first" if gold_first else "random",
          **({"piece_prefix": piece_prefix} if prefix else {}), "doc_pieces": pieces,
          **({"piece_heads_worst_rank": worst_head} if worst_head else {}),
          "exact_gold_answer_pct": round(100 * exact_gold / n, 1), "variants": rows,
          "elapsed_s": round(time.perf_counter() - t0, 1)})
    return 0


def plot(rows: dict[str, dict], shares: list[float], rules: tuple[str, ...], path: str, title: str) -> None:
    """Identical answers and extra NLL against the share recomputed, one line per selection, from
    ``none`` (the last token only) to ``all`` (the exact splice)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (same, nll) = plt.subplots(1, 2, figsize=(10, 4))
    for i, rule in enumerate(rules):
        style = "o-" if rule == "tail" else "^--" if rule == "deviation@all" else f"{'sDvP*'[i % 5]}-"
        points = [rows["none@0"], *(rows[f"{rule}@{s:g}"] for s in shares), rows["all@1"]]
        x = [p["recomputed_pct"] for p in points]
        same.plot(x, [p["identical_pct"] for p in points], style, label=rule)
        nll.plot(x, [p["extra_nll_per_token"] for p in points], style, label=rule)
    same.set(xlabel="share of the block recomputed (%)", ylabel="answers identical to the exact splice (%)")
    nll.set(xlabel="share of the block recomputed (%)", ylabel="extra NLL of the exact answer (nats / token)")
    same.legend()
    nll.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
