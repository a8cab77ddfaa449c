"""The vLLM backend on one GPU: what a hop costs in its stream and prefix modes, against plain vLLM
re-prefilling the full text at every hop.

N questions decode as one batch. Every answer is made to write a retrieve marker after each
``--segment`` tokens of its own, ``--hops`` times (the model's own greedy tokens in between, no stop
before the last segment); each hop's evidence is a fixed block of about ``--evidence-tokens`` tokens.
One ``AsyncLLM`` (prefix caching on) serves three runs:

* ``stream``  - ``engine.backend: vllm``, one resumable request per row (``StreamingInput``): the
                hop's chunk (marker token + evidence) is prefilled onto the KV the request kept;
* ``prefix``  - the same engine loop, a new request per call with the row's token ids, the prefix
                cache holding everything but the partial last block and the evidence;
* ``reprefill`` - what string-based RIG systems do with plain vLLM: per hop, the text so far plus
                the marker and the evidence, tokenised again, sent as a new request that decodes the
                next segment; a per-request ``cache_salt`` keeps the prefix cache out of it.

Per hop (medians over rows): latency (the engine step that prefilled the evidence; for
``reprefill`` the new request's time to first token), tokens vLLM took from KV or cache, tokens it
evaluated. Per run: decode tokens/s (all rows' generated tokens over the run's wall time), and
whether stream and prefix gave the same tokens (greedy; vLLM's batch-dependent numerics can split
rows, which is reported, not asserted). stdout: a table, then ONE JSON line last.

    python bench/vllm_gpu.py                                   # Qwen2.5-32B-Instruct AWQ
    python bench/vllm_gpu.py --quant nf4                       # the bitsandbytes nf4 checkpoint (a vLLM with bitsandbytes)
    python bench/vllm_gpu.py /models/qwen2.5-7b --questions 16 --hops 3

Without CUDA it prints a skip notice and a JSON line with ``skipped`` and exits 0; with CUDA but
without vLLM it exits 2 naming ``pip install 'rig_decode[vllm]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

from rig_decode.config import RigConfig
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.engine.runner_vllm import EventLoopThread, vllm_runner_on
from rig_decode.engine.vllm_api import VllmMissingError, engine_args_kwargs, load_vllm_api
from rig_decode.evidence import EvidenceFormatter
from rig_decode.markers import MarkerSpec
from rig_decode.prompt import build_prompt
from rig_decode.retrieval.base import Hit

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script (the tests load this file)
from harness import Table, emit  # noqa: E402

DEFAULT_MODELS = {"awq": "Qwen/Qwen2.5-32B-Instruct-AWQ", "nf4": "unsloth/Qwen2.5-32B-Instruct-bnb-4bit"}
TOP_K = 3
QUESTIONS = ["Which release fixed error E{n} and who approved it?",
             "What does clause {n} of the service agreement say about data loss?",
             "Who maintains module {n} of the gateway, and since when?",
             "Which team owns incident {n}, and what was its root cause?"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a model directory or hub id (default: by --quant)")
    p.add_argument("--quant", choices=sorted(DEFAULT_MODELS), default="awq",
                   help="the default checkpoint; nf4 also loads MODEL with bitsandbytes (AWQ is read from its config)")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--hops", type=int, default=2)
    p.add_argument("--segment", type=int, default=48, help="tokens each answer writes before each hop")
    p.add_argument("--evidence-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-mem", type=float, default=0.9, help="gpu_memory_utilization")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--top-logprobs", type=int, default=20)
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--modes", default="stream,prefix,reprefill")
    return p.parse_args(argv)


class ForceHops:
    """Row ``seq_id`` writes marker h after ``segment * (h + 1)`` tokens of its own, and may not stop
    before its last segment is written (so every run does the same amount of work)."""

    def __init__(self, vocab, stop_ids, hops: int, segment: int):
        self.vocab, self.stop_ids, self.hops, self.segment = vocab, list(stop_ids), hops, segment
        self.plans: dict[int, list[tuple[int, list[int]]]] = {}

    def plan(self, seq_id: int) -> list[tuple[int, list[int]]]:
        if seq_id not in self.plans:
            plan, start = [], self.segment
            for h in range(self.hops):
                ids = self.vocab.marker_token_ids(marker_query(seq_id, h))
                plan.append((start, ids))
                start += len(ids) + self.segment
            self.plans[seq_id] = plan
        return self.plans[seq_id]

    def total(self, seq_id: int) -> int:
        return (self.hops + 1) * self.segment + sum(len(ids) for _, ids in self.plan(seq_id))

    def apply(self, rows, scores):
        for i, s in enumerate(rows):
            k, forced = s.num_generated, None
            for start, ids in self.plan(s.seq_id):
                if 0 <= k - start < len(ids):
                    forced = ids[k - start]
            if forced is not None:
                scores[i].fill_(float("-inf"))
                scores[i, forced] = 0.0
            elif k < self.total(s.seq_id):
                scores[i, self.stop_ids] = float("-inf")
        return scores


def marker_query(seq_id: int, hop: int) -> str:
    return f"facts for question {seq_id} part {hop}"


class FixedEvidence:
    """``TOP_K`` long passages for any query; the evidence budget cuts the block to size."""

    def __init__(self, words: int):
        self.hits = [Hit(f"d{j}", " ".join(f"Fact {j}.{w}: release {w} shipped on day {w}." for w in range(words)),
                         1.0 - 0.1 * j, title=f"doc {j}") for j in range(TOP_K)]

    def search_batch(self, queries, top_k, filters=None):
        return [self.hits[:top_k] for _ in queries]


def prompts(tokenizer, n: int) -> list[list[int]]:
    spec = MarkerSpec.special_token()
    return [build_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)].format(n=1000 + i), spec) for i in range(n)]


def _median(values):
    return round(statistics.median(values), 2) if values else None


def run_rig(engine, api, tokenizer, loop, mode: str, args, prompt_ids) -> tuple[dict, list]:
    runner = vllm_runner_on(engine, api, len(tokenizer), mode=mode, top_logprobs=args.top_logprobs,
                        lookahead=args.lookahead, context_limit=args.max_model_len, loop=loop)
    options = EngineOptions(max_iterations=args.hops, evidence_token_budget=args.evidence_tokens, top_k=TOP_K,
                            max_batch_size=len(prompt_ids))
    rig = RigEngine(None, tokenizer, FixedEvidence(args.evidence_tokens), options, runner=runner)
    force = ForceHops(rig.vocab, rig.stop_ids, args.hops, args.segment)
    rig.processors.insert(0, force)
    seqs = [rig.new_sequence(ids, seq_id=i, max_new_tokens=force.total(i)) for i, ids in enumerate(prompt_ids)]
    t0 = time.perf_counter()
    rig.generate(seqs)
    wall = time.perf_counter() - t0
    rig.close()
    hops = []
    for h in range(args.hops):
        steps = [s.trace.retrieval_steps[h] for s in seqs if len(s.trace.retrieval_steps) > h]
        server = [st.info.get("server") or {} for st in steps]
        hops.append({"hop": h + 1, "rows": len(steps), "ms": _median([st.splice_ms for st in steps]),
                     "cached": _median([i["cache_n"] for i in server if i.get("cache_n") is not None]),
                     "evaluated": _median([i["prompt_n"] for i in server if i.get("prompt_n") is not None]),
                     "evidence_tokens": _median([st.evidence_tokens for st in steps])})
    generated = sum(s.num_generated for s in seqs)
    return {"hops": hops, "wall_s": round(wall, 3), "generated_tokens": generated,
            "decode_tok_s": round(generated / wall, 1), "calls": runner.calls,
            "finish": sorted({s.finish_reason for s in seqs})}, seqs


async def _reprefill_row(engine, api, tokenizer, ids: list[int], i: int, args, evidence_text: str):
    spec, hops, generated = MarkerSpec.special_token(), [], 0
    for h in range(args.hops + 1):
        params = api.SamplingParams(max_tokens=args.segment, temperature=0.0, ignore_eos=True)
        prompt = api.TokensPrompt(prompt_token_ids=ids, cache_salt=uuid.uuid4().hex)
        t0, first, final = time.perf_counter(), None, None
        async for out in engine.generate(prompt, params, f"bench-reprefill-{i}-{h}-{uuid.uuid4().hex[:8]}"):
            first = first or time.perf_counter()
            final = out
        new = list(final.outputs[0].token_ids)
        generated += len(new)
        if h:
            cached = final.num_cached_tokens or 0
            hops.append({"ms": (first - t0) * 1e3, "cached": cached, "evaluated": len(ids) - cached})
        if h < args.hops:  # the text so far, the marker and the evidence, tokenised again
            text = tokenizer.decode(ids + new, skip_special_tokens=False)
            text += spec.render(marker_query(i, h)) + evidence_text
            ids = tokenizer.encode(text, add_special_tokens=False)
    return hops, generated


def run_reprefill(engine, api, tokenizer, loop, args, prompt_ids) -> dict:
    formatter = EvidenceFormatter(tokenizer, args.evidence_tokens)
    block = formatter.render_block(FixedEvidence(args.evidence_tokens).hits, 1, budget=args.evidence_tokens)
    evidence_text = tokenizer.decode(block.token_ids, skip_special_tokens=False)

    async def all_rows():
        return await asyncio.gather(*(_reprefill_row(engine, api, tokenizer, list(ids), i, args, evidence_text)
                                      for i, ids in enumerate(prompt_ids)))

    t0 = time.perf_counter()
    rows = loop.run(all_rows())
    wall = time.perf_counter() - t0
    hops = []
    for h in range(args.hops):
        per = [r[0][h] for r in rows if len(r[0]) > h]
        hops.append({"hop": h + 1, "rows": len(per), "ms": _median([p["ms"] for p in per]),
                     "cached": _median([p["cached"] for p in per]), "evaluated": _median([p["evaluated"] for p in per]),
                     "evidence_tokens": len(block.token_ids)})
    generated = sum(r[1] for r in rows)
    return {"hops": hops, "wall_s": round(wall, 3), "generated_tokens": generated,
            "decode_tok_s": round(generated / wall, 1), "calls": len(rows) * (args.hops + 1)}


def run(engine, api, tokenizer, loop, args) -> dict:
    """Every mode of ``args.modes`` on one engine; the JSON result."""
    modes = [m for m in args.modes.split(",") if m]
    prompt_ids = prompts(tokenizer, args.questions)
    result = {"bench": "vllm_gpu", "vllm": api.version, "questions": args.questions, "hops": args.hops,
              "segment": args.segment, "evidence_tokens": args.evidence_tokens, "modes": {}, "errors": {}}
    tokens = {}
    for mode in modes:
        try:
            if mode == "reprefill":
                result["modes"][mode] = run_reprefill(engine, api, tokenizer, loop, args, prompt_ids)
                continue
            if mode == "stream" and api.StreamingInput is None:
                result["errors"][mode] = f"vLLM {api.version} has no StreamingInput"
                continue
            run_rig(engine, api, tokenizer, loop, mode, args, prompt_ids[:1])  # warm-up, not measured
            result["modes"][mode], seqs = run_rig(engine, api, tokenizer, loop, mode, args, prompt_ids)
            tokens[mode] = [s.token_ids for s in seqs]
        except Exception as e:  # noqa: BLE001 - one failing mode must not hide the others' figures
            result["errors"][mode] = f"{type(e).__name__}: {e}"
    if "stream" in tokens and "prefix" in tokens:
        same = sum(a == b for a, b in zip(tokens["stream"], tokens["prefix"]))
        result["stream_prefix_same_tokens"] = f"{same}/{len(tokens['stream'])}"
    return result


def print_table(result: dict, out=None) -> None:
    hops = Table(("mode", "<"), "hop", "rows", ("hop ms", "{:g}"), ("cached", "{:g}"), ("evaluated", "{:g}"),
                 ("evidence", "{:g}"))
    runs = Table(("mode", "<"), "decode tok/s", "wall s", "tokens", "calls")
    for mode, r in result["modes"].items():
        for h in r["hops"]:
            hops.add(mode, h["hop"], h["rows"], h["ms"], h["cached"], h["evaluated"], h["evidence_tokens"])
        runs.add(mode, r["decode_tok_s"], r["wall_s"], r["generated_tokens"], r["calls"])
    hops.print(out)
    print(file=out)
    runs.print(out)
    for mode, err in result["errors"].items():
        print(f"{mode}: error: {err}", file=out)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        notice = "no CUDA device: this benchmark needs a GPU with vLLM installed; skipped"
        print(f"bench/vllm_gpu.py: {notice}", file=sys.stderr)
        emit({"bench": "vllm_gpu", "skipped": notice})
        return 0
    try:
        api = load_vllm_api()
    except VllmMissingError as e:
        print(f"bench/vllm_gpu.py: {e}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    model = args.model or DEFAULT_MODELS[args.quant]
    cfg = RigConfig.from_dict({
        "model": {"name": model, "quantization": "nf4" if args.quant == "nf4" else "none", "dtype": "auto"},
        "engine": {"backend": "vllm", "vllm": {"max_model_len": args.max_model_len, "gpu_memory_utilization":
                                               args.gpu_mem, "enforce_eager": args.enforce_eager,
                                               "top_logprobs": args.top_logprobs, "lookahead": args.lookahead}}})
    try:
        engine_args = api.AsyncEngineArgs(**engine_args_kwargs(cfg, api))
    except ValueError as e:  # e.g. --quant nf4 on a vLLM without bitsandbytes (0.33.0 has none)
        print(f"bench/vllm_gpu.py: {e}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model)
    loop = EventLoopThread()
    print(f"[bench] loading {model} in vLLM {api.version}", file=sys.stderr)

    async def start():
        return api.AsyncLLM.from_engine_args(engine_args)

    engine = loop.run(start())
    try:
        result = run(engine, api, tokenizer, loop, args)
    finally:
        async def stop():
            engine.shutdown()

        loop.run(stop(), timeout=120)
        loop.close()
    result["model"] = model
    print_table(result)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
