"""The KV re-rotation kernel's backends side by side: torch reference, Triton, native (C++ / CUDA).

What a hop spends in ``kernels.rope_shift_layers_`` for one row of a real architecture's cache
(every layer, its KV heads and head size, its dtype):

* evict - a ``--span``-token span dropped from the middle of a ``--context``-token row: every key
          after it is rotated back by the span (``HFModelRunner.evict``, ``append_format: summary``);
* stage - a ``--span``-token evidence block's keys rotated to their place after the context
          (the zero-prefill splice, ``step(staged=)``).

Every backend that can serve the device runs (Triton on CUDA only: on CPU it needs its interpreter)
and its result is compared with the torch reference's (max |diff|, in the keys' dtype). Each figure
is the median of ``--repeats`` calls after one warm-up, CUDA synchronised; GB/s counts each rotated
key read once and written once. The indices are CPU tensors, as the runner passes them; on CUDA,
``syncs`` counts the device syncs torch reports during one call (``torch.cuda.set_sync_debug_mode``).

    python bench/rope_shift.py                     # the embedded default's KV shapes (fp32 on CPU)
    python bench/rope_shift.py --model qwen2.5-32b # Qwen2.5-32B's (bf16 on CUDA), 8k context

With ``--shapes`` (random weights, ``bench/random_qwen.py``; ``--quant``, ``--cap-gib``), the model's
KV shapes, and also the whole of ``HFModelRunner.evict`` on it: the span dropped from a row just
prefilled (a fresh prefill before each call, untimed)::

    python bench/rope_shift.py --shapes qwen2.5-32b --cap-gib 24

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager

import torch

from rig_decode.engine.kv import resolve_architecture
from rig_decode.kernels import backend_for, has_triton, native, rope_shift_layers_

import random_qwen  # bench/ is on sys.path when run as a script
from harness import Table, emit
from timing import Clock, pick_device, prefill, random_ids, syncs_if_cuda

ROPE_THETA = 10_000.0


@contextmanager
def forced(backend: str):
    """``rope_shift_layers_`` with ``backend`` (``RIG_KERNELS``) inside the block."""
    before = os.environ.get("RIG_KERNELS")
    os.environ["RIG_KERNELS"] = backend
    try:
        yield
    finally:
        if before is None:
            del os.environ["RIG_KERNELS"]
        else:
            os.environ["RIG_KERNELS"] = before


def backends(device: torch.device) -> list[str]:
    found = ["torch"]
    if device.type == "cuda" and has_triton():
        found.append("triton")
    if native.supports(device):
        found.append("native")
    return found


def cases(context: int, span: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(rows, cols, shift) of each operation on a one-row cache ``context + span`` columns wide, on
    the host (as the runner gives them)."""
    start = (context - span) // 2
    after = torch.arange(start + span, context)
    block = torch.arange(context, context + span)
    return {
        "evict": (torch.zeros_like(after), after, torch.full(after.shape, -float(span))),
        "stage": (torch.zeros_like(block), block, torch.full(block.shape, float(context))),
    }


@torch.no_grad()
def runner_evict_ms(model, context: int, span: int, repeats: int, clock: Clock, gen,
                    kv_budget: int | None = None) -> float:
    """``HFModelRunner.evict`` of ``span`` tokens from the middle of a ``context``-token row: every
    key after the span is re-rotated (with the kernel ``kernels.backend_for`` picks)."""
    start = (context - span) // 2
    ids = random_ids(gen, model.config.vocab_size, context)
    state = {"runner": prefill(model, [ids], kv_budget)[0]}

    def refill():  # each eviction starts from a fresh prefill of the same row
        state["runner"] = None  # free the old cache before the new one is built
        state["runner"] = prefill(model, [ids], kv_budget)[0]

    return clock.median_ms(lambda: state["runner"].evict(0, start, start + span), repeats, reset=refill)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="an architecture `rig plan` knows")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--context", type=int, default=None, help="tokens in the row (default 8192 on CUDA, 2048 on CPU)")
    ap.add_argument("--span", type=int, default=256, help="tokens evicted / staged")
    ap.add_argument("--repeats", type=int, default=20)
    random_qwen.add_arguments(ap, device=False)
    args = ap.parse_args(argv)
    device = pick_device(args.device)
    cuda, clock = device.type == "cuda", Clock(device)
    context = args.context or (8192 if cuda else 2048)
    if not 0 < args.span < context:
        raise SystemExit(f"--span must be between 1 and the context ({context}), got {args.span}")
    model = random_qwen.from_arguments(args) if args.shapes else None
    name, arch = (args.shapes, model.config) if model is not None else resolve_architecture(args.model)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, dim = arch.num_key_value_heads, arch.head_dim
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    gen = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(1, heads, context + args.span, dim, device=device, dtype=dtype, generator=gen)
            for _ in range(arch.num_hidden_layers)]
    print(f"[bench/kernels] {name}: {arch.num_hidden_layers} layers x {heads} KV heads x {dim}, "
          f"{str(dtype).removeprefix('torch.')} on {device}, {context} context, span {args.span}", file=sys.stderr)

    table = Table(("op", "<"), ("backend", "<"), ("positions", "{:,}"), ("ms", "{:.3f}"), ("GB/s", "{:.1f}"),
                  ("max |diff| vs torch", "{:.2e}"), "syncs")
    result = {"bench": "kernels", "model": name, "device": str(device) if not cuda else
              torch.cuda.get_device_name(device), "dtype": str(dtype).removeprefix("torch."),
              "layers": arch.num_hidden_layers, "context": context, "span": args.span, "ops": {}}
    for op, (rows, cols, shift) in cases(context, args.span).items():
        with forced("torch"):
            want = rope_shift_layers_([k.clone() for k in base], rows, cols, shift, inv_freq)
        moved = 2 * rows.numel() * heads * dim * base[0].element_size() * len(base)  # read + write
        for backend in backends(device):
            with forced(backend):
                got = rope_shift_layers_([k.clone() for k in base], rows, cols, shift, inv_freq)
                diff = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
                del got
                work = [k.clone() for k in base]  # rotated again at every call: rotations compose
                call = lambda: rope_shift_layers_(work, rows, cols, shift, inv_freq)  # noqa: E731
                ms = clock.median_ms(call, args.repeats)
                syncs = syncs_if_cuda(clock, call)
                work = None  # free the copy before the next backend makes its own
            table.add(op, backend, rows.numel(), ms, moved / ms / 1e6, diff, syncs)
            result["ops"].setdefault(op, {"positions": rows.numel()})[backend] = {
                "ms": round(ms, 4), "gb_s": round(moved / ms / 1e6, 2), "max_abs_diff": diff, "syncs": syncs}
        del want
    if model is not None:
        backend = f"runner ({backend_for(device)})"
        ms = runner_evict_ms(model, context, args.span, args.repeats, clock, torch.Generator().manual_seed(0))
        positions = result["ops"]["evict"]["positions"]
        table.add("evict", backend, positions, ms, None, None, None)
        result["runner_evict_ms"] = round(ms, 4)

    table.print()
    for op, per in result["ops"].items():
        fastest = min((b for b in per if b != "positions"), key=lambda b: per[b]["ms"])
        per["fastest"] = fastest
        per["speedup_vs_torch"] = round(per["torch"]["ms"] / per[fastest]["ms"], 2)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
