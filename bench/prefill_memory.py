"""The activation peak of a prefill at Qwen2.5-32B layer widths, per prefill chunk, against what
``rig plan`` assumes (``engine.kv.prefill_activation_bytes``).

A Qwen2-architecture model as wide as Qwen2.5-32B (hidden 5120, MLP 27648, 40 query and 8 KV heads
of 128) but ``--layers`` deep (random weights, ``bench/random_qwen.py``), with a ``--vocab`` of
1,024: only the last token's logits are computed, so the vocabulary adds its embedding rows and
one row of logits, nothing per chunk (the plan counts the real vocabulary's row). Per chunk size
(``none``: the prompt in one forward) a ``--context``-token prompt goes through
``HFModelRunner(model, 0, prefill_chunk=chunk)``, each in a fresh process, so that nothing an
earlier run allocated hides its peak.

How the peak is measured, on CPU: after loading, the process's resident memory (``VmRSS``, with
``malloc_trim`` so that freed heap is given back first) is the baseline and the kernel's peak
counter is reset (``/proc/self/clear_refs``: ``VmHWM`` restarts at the current size); after the
prefill, ``VmHWM`` less the baseline is the prefill's peak. The child runs with glibc's mmap
threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor's pages go back at once
and the resident peak counts live tensors, not heap that glibc keeps for reuse. On CUDA
(``--device cuda``) torch's ``max_memory_allocated`` over the allocated memory at the start, which
likewise counts live tensors, not the allocator's cache. Either way the KV the prefill adds (its
buffers' bytes after, less before) is not an activation and is taken off.

By default only the last chunk runs: the KV of the first ``context - chunk`` tokens is put in place
(random values, in a buffer with room for the whole prompt, so the measured forward allocates no
KV) and the prompt's last ``chunk`` tokens are fed, as the chunked prefill's last forward feeds
them. A chunked prefill peaks there: every forward allocates the same but its attention, which
grows with the context. ``--full`` computes every chunk instead (the KV then grows during the
prefill; its buffers' moves add at most one layer's old buffer): at Qwen2.5-32B widths that is
about 150 s a layer per chunk size on two cores in fp32. The unchunked row (``none``) has to compute
the whole prompt in one forward, so it runs ``--none-layers`` deep (default 1, ~3 min): the peak is
one layer's, and a second layer adds only its input, one ``[tokens, hidden]`` tensor, which the
plan counts.

The default dtype is fp32: this machine's CPU has no bf16 instructions (a bf16 matmul runs at a
tenth of fp32's speed). Every tensor is counted in elements, so the bf16 peak is the same formula at
2 bytes; ``--dtype bfloat16`` measures it directly.

    python bench/prefill_memory.py                                  # 256,512,1024,2048,none; ~5 min CPU
    python bench/prefill_memory.py --chunks 512 --dtype bfloat16    # the plan's dtype, one chunk size
    python bench/prefill_memory.py --chunks 256 --full              # every chunk computed

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

from rig_decode.engine.kv import MiB, prefill_activation_bytes, resolve_architecture

from harness import Table, emit  # bench/ is on sys.path when run as a script

WIDTHS = "qwen2.5-32b"


def shape(layers: int, vocab: int) -> dict:
    """Qwen2.5-32B's layer widths (``random_qwen.SHAPES``), ``layers`` deep, a ``vocab`` of tokens."""
    from random_qwen import SHAPES

    return {**SHAPES[WIDTHS], "num_hidden_layers": layers, "vocab_size": vocab}


# -- one measurement, in its own process --------------------------------------------------------------


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Peak:
    """The peak memory of a block of code above what is held when it starts: the process's resident
    memory on CPU, torch's allocated memory on CUDA."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the kernel, so it counts again
        self.base = _proc_status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts at the current resident size

    def above_start(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _proc_status("VmHWM") - self.base


def kv_held(runner) -> int:
    """Bytes of the runner's KV buffers, spare room included."""
    from rig_decode.engine.kv import kv_bytes_per_token_of

    return runner.kv.reserved_slots * kv_bytes_per_token_of(runner.model)


def measure(spec: dict) -> dict:
    """One prefill's activation peak (``spec``: the child's arguments)."""
    import torch

    from rig_decode.engine.runner_hf import HFModelRunner
    from random_qwen import build_model
    from timing import pick_device

    device, dtype = pick_device(spec["device"]), getattr(torch, spec["dtype"])
    model = build_model(shape(spec["layers"], spec["vocab"]), device, dtype)
    chunk, context = spec["chunk"], spec["context"]
    ids = torch.randint(2, spec["vocab"], (context,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = HFModelRunner(model, 0, prefill_chunk=chunk)
    runner.reset(0)
    before = 0 if spec["full"] or not chunk else context - chunk
    if before:  # the first tokens' KV in place, in buffers with room for the whole prompt
        cfg = model.config
        kv = torch.randn(1, cfg.num_key_value_heads, before, cfg.head_dim, dtype=dtype, device=device)
        runner.kv.grow(1, columns=before, like=[(kv, kv)] * cfg.num_hidden_layers)
        runner.kv.seed(0, [before], [(kv, kv)] * cfg.num_hidden_layers)
        for layer in runner.cache.layers:
            layer.reserve(context, layer.keys)
            layer.truncate(before)
        del kv
    peak, kv_before = Peak(device), kv_held(runner)
    peak.start()
    t0 = time.perf_counter()
    with torch.no_grad():
        runner.step(runner.add_rows([ids[before:]], share_prefix=False) if not before else [ids[before:]])
    seconds = time.perf_counter() - t0
    above, kv_added = peak.above_start(), kv_held(runner) - kv_before
    return dict(chunk=chunk, layers=spec["layers"], fed=context - before, peak=above, kv_added=kv_added,
                activations=above - kv_added, seconds=round(seconds, 1), threads=torch.get_num_threads())


# -- the table ------------------------------------------------------------------------------------------


def run_child(args, chunk: int | None) -> dict:
    layers = args.layers if chunk else args.none_layers
    spec = dict(chunk=chunk, context=args.context, layers=layers, vocab=args.vocab, dtype=args.dtype,
                device=args.device, full=args.full)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}
    try:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                             text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(chunk=chunk, error=f"stopped after {args.timeout} s")
    if out.returncode:
        return dict(chunk=chunk, error=(out.stderr.strip().splitlines() or ["failed"])[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="256,512,1024,2048,none", help="chunk sizes in tokens; none: one forward")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--none-layers", type=int, default=1, help="layers of the unchunked row (the slow one)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    ap.add_argument("--full", action="store_true", help="compute every chunk, not only the last")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per chunk size")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0

    _, arch = resolve_architecture(WIDTHS)
    chunks = [None if c.strip() == "none" else int(c) for c in args.chunks.split(",")]
    table = Table(("chunk", "<"), "layers", "tokens fed", ("measured MiB", "{:.0f}"), ("plan MiB", "{:.0f}"),
                  ("plan / measured", "{:.2f}"), ("plan bf16 MiB", "{:.0f}"), ("KV added MiB", "{:.0f}"),
                  ("s", "{:.0f}"))
    rows = []
    for chunk in chunks:
        r = run_child(args, chunk)
        c = chunk or args.context
        r["plan"] = prefill_activation_bytes(arch, c, args.context, args.dtype, rows=1)
        r["plan_bf16"] = prefill_activation_bytes(arch, c, args.context, "bfloat16", rows=1)
        rows.append(r)
        label = chunk or "none"
        if "error" in r:
            table.add(label, None, None, None, r["plan"] / MiB, None, r["plan_bf16"] / MiB, None, None, r["error"])
            continue
        measured = r["activations"]
        table.add(label, r["layers"], r["fed"], measured / MiB, r["plan"] / MiB, r["plan"] / max(1, measured),
                  r["plan_bf16"] / MiB, r["kv_added"] / MiB, r["seconds"])
    print(f"{args.context:,}-token prefill at Qwen2.5-32B widths, {args.dtype}, "
          f"{'every chunk' if args.full else 'the last chunk'} measured ({args.device})")
    table.print()
    print(f"At 64 layers the activations are the same (one layer's transients at a time); the weights and "
          f"the KV grow with the layers: {arch.kv_bytes_per_token() * args.context / MiB:,.0f} MiB of bf16 KV "
          f"for {args.context:,} tokens at 64 layers.")
    emit(dict(bench="prefill_memory", widths=WIDTHS, context=args.context, dtype=args.dtype,
              device=args.device, full=args.full, rows=rows), digits=3)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
