"""How far is evidence KV computed out of context from the same KV computed in context?

Zero-prefill reuses an evidence piece's KV computed alone. This measures, on the real default model,
one evidence line after a chat prompt: the first layer's keys after re-rotation to their in-context
positions (must match: the shift is exact), and each listed layer's values computed alone, after
the prompt's first four tokens, and after the whole system prompt, as a relative L2 distance from the
in-context values.

    python bench/zero_prefill_drift.py [--layers 1,10,29]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys

import torch

from rig_decode.config import ModelConfig
from rig_decode.models.kv_buffers import new_cache
from rig_decode.kernels import rope_of, rope_shift_
from rig_decode.markers import MarkerSpec
from rig_decode.models.cache_arg import cache_kw
from rig_decode.models.loader import load_model
from rig_decode.prompt import build_prompt

from harness import Table, emit  # bench/ is on sys.path when run as a script

QUESTION = "Who makes the Lumora K7?"
EVIDENCE = "[1] Lumora K7: The Lumora K7 is made by Vastrel.\n"


@torch.no_grad()
def kv_of(model, ids: list[int]):
    cache = new_cache(model.config)
    model(input_ids=torch.tensor([ids]), **cache_kw(cache), use_cache=True)
    return cache.layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,10,29")
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    model, tok = load_model(ModelConfig(adapter=None))
    prompt = build_prompt(tok, QUESTION, MarkerSpec.special_token())
    piece = tok.encode(EVIDENCE, add_special_tokens=False)
    at = len(prompt)
    ref = kv_of(model, prompt + piece)

    alone = kv_of(model, piece)
    keys = alone[0].keys.clone()
    n = len(piece)
    rope = rope_of(model)
    rope_shift_(keys, torch.zeros(n, dtype=torch.long), torch.arange(n), torch.full((n,), float(at)),
                rope.inv_freq, rope.interleaved)
    key_err = (keys - ref[0].keys[:, :, at:]).abs().max().item()

    rows = {}
    for name, prefix in (("alone", []), ("after 4 prompt tokens", prompt[:4]), ("after the system prompt", prompt[: at - 8])):
        got = kv_of(model, prefix + piece)
        rows[name] = {str(L): round(((got[L].values[:, :, len(prefix):] - ref[L].values[:, :, at:]).norm()
                                     / ref[L].values[:, :, at:].norm()).item(), 3) for L in layers}
    print(f"layer-0 keys re-rotated to their in-context positions: max abs error {key_err:.2e}\n")
    table = Table(("evidence values computed", "<"), *((f"layer {L}", "{:.0%}") for L in layers), markdown=True)
    for name, r in rows.items():
        table.add(name, *(r[str(L)] for L in layers))
    table.print()
    emit({"bench": "zero_prefill_drift", "layer0_key_max_abs_error": key_err, "values_rel_l2": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
