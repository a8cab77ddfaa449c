"""Peers: the systems users would pick instead of rig, on the same multi-hop work.

One workload: ``--questions`` (16) questions of the synthetic benchmark (``rig synth``; ``--dataset``
is its test.jsonl, whose folder holds corpus.jsonl), by default those whose gold answer needs at
least ``--min-hops`` (2) hops, answered by the embedded default model with its marker adapter,
greedy, hop budget ``--max-iterations`` (3), at most ``--max-tokens`` sampled tokens each, over the
real hybrid retriever built on the benchmark's corpus (as ``rig eval`` builds it, without its
query-embedding cache, which would hand a round's later systems the first one's embeddings), with
``--search-ms`` (150) added to every search call (a remote index). Every system gets the same
prompt token ids and runs at each ``--concurrency`` (1 and 8). Systems (``--systems``):

* ``rig-hf``           rig in process (``engine.backend: hf``): evidence spliced into the KV cache;
* ``rig-vllm-stream``  rig on vLLM in process, one resumable request per row (``engine.vllm.mode: stream``);
* ``vllm-alone``       vLLM with no rig in the loop: the same prompts, each decoded for as many tokens as
                       rig-vllm-stream generated for it (no hops, no log-probabilities), the bound
                       rig-vllm-stream's decoding between hops is measured against;
* ``rig-vllm-prefix``  rig on vLLM, a new request per call, vLLM's prefix cache (``mode: prefix``);
* ``rig-llama``        rig on llama-server (``engine.backend: remote``; ``--llama-server URL``): one
                       streamed request per stretch between hops, each row on its own slot;
* ``rig-llama-lookahead``  the same over requests of 16 tokens (``engine.remote.stream: false``);
* ``resubmit-vllm``    the string loop Search-R1 and FlashRAG run on vLLM: generate until the stop
                       string ``<|endofretrieve|>`` or EOS, decode the ids to text, parse the query,
                       search, append the evidence text (rig's evidence block, the same text), tokenise
                       the whole text again and submit it as a new request (prefix caching on); rows
                       of a batch advance in lockstep (each round waits for every row, one search call);
* ``resubmit-llama``   the same loop on llama-server's ``/completion`` with ``cache_prompt: true``.

At concurrency c, rig keeps c questions in its engine's batch (all queued at once, continuous
batching, as ``bench/engine.py`` drives it); resubmit runs batches of c rows in lockstep.

Per system: per-hop latency p50 (from the end marker to the first token after the evidence; for rig,
the trace's ``first_token_ms``: from the marker's completion to the first token sampled after the
splice), tokens evaluated per hop p50 (rig-hf: the evidence block + the marker token; on vLLM and
llama-server what the engine reported: ``prompt_n`` in the hop's trace, or prompt tokens minus
``num_cached_tokens`` / llama-server's ``timings.prompt_n``), re-tokenisation mismatches (resubmit:
positions at which the re-tokenised prompt's ids differ from the ids the model had for the same
text, i.e. the previous round's prompt plus what it generated; rig never re-tokenises: 0),
end-to-end generated tokens/s at each concurrency (all rows' generated tokens over the run's wall
time), decode tokens/s (``dec/s``: each row's generated tokens over its time less its hops', summed
over rows), engine calls (rig's runner: requests, streams or chunks), p95 request latency
(admission to last token, at the highest concurrency), and answers equal
to rig-hf's (count/total, against rig-hf at the lowest concurrency). A system whose engine is
missing is reported as skipped with the reason. stdout: a table, the ratios rig-vllm-stream vs
resubmit-vllm and rig-llama vs resubmit-llama (per hop, end to end), rig-vllm-stream's decoding
against vllm-alone's, then ONE JSON line last.

    python bench/peers.py [--dataset out/synth/test.jsonl] [--questions 16] [--search-ms 150]
                          [--concurrency 1,8] [--systems rig-hf,rig-vllm-stream,...] [--llama-server URL]
                          [--repeat N]   # N interleaved runs each: median figures, rig vs the loop run by run

``rig synth --out out/synth`` writes the dataset. llama-server must serve the merged model (adapter
folded in, converted to GGUF) with ``-np`` at least the highest concurrency, ``--special`` (the
end marker is a special token: without it the server writes no text for it, so the resubmit loop's
stop string never matches and every round runs to its token limit), ``--slot-save-path DIR`` and
``--cache-ram 0`` (its slots are erased before every run, as vLLM's prefix cache is reset). On vLLM's
CPU build the KV cache gets ``--vllm-kv-gib`` (1) and ``--max-model-len`` (4096); the three vLLM
systems share one engine, its prefix cache reset before every run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rig_decode.markers import MarkerSpec

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script (the tests load this file)
from harness import emit  # noqa: E402
from peers_report import SYSTEMS, RunResult, combine_runs, print_report, result_json, summarize  # noqa: E402
from peers_systems import System, erase_llama_slots, log, run_rig, vllm_systems  # noqa: E402
from resubmit import LlamaCompleter, run_resubmit  # noqa: E402
from workload import load_synth  # noqa: E402


class SearchDelay:
    """A retriever plus ``ms`` of simulated network time per ``search_batch`` call."""

    def __init__(self, base, ms: float):
        self.base, self.s = base, ms / 1e3
        self.calls = 0

    def search_batch(self, queries, top_k, filters=None):
        self.calls += 1
        if self.s:
            time.sleep(self.s)
        return self.base.search_batch(queries, top_k, filters)

    def __getattr__(self, name):  # docs, knows, ...
        return getattr(self.base, name)


# -- measuring -----------------------------------------------------------------------------------------


def measure(systems: list[System], prompts: list[list[int]], concurrency: list[int], max_new_tokens: int,
            warmup: int = 1, warmup_tokens: int = 8,
            repeat: int = 1) -> tuple[dict[str, dict[int, RunResult]], dict[str, str]]:
    """Every system at every concurrency, ``repeat`` times over, interleaved (each round runs every
    concurrency of every system in turn, so a slow spell of the machine falls on all of them alike;
    every other round in the reverse order, so that no system always runs right after the same one);
    ({name: {concurrency: the runs combined}}, {name: error})."""
    runs: dict[str, dict[int, list[RunResult]]] = {}
    errors: dict[str, str] = {}

    def attempt(system: System, what, label: str) -> None:
        try:
            what()
        except Exception as e:  # noqa: BLE001 - one failing system must not hide the others' figures
            errors[system.name] = f"{type(e).__name__}: {e}"
            log(f"{system.name}{label}: error: {errors[system.name]}")

    if warmup:
        for system in systems:
            log(f"{system.name}: warm-up ({warmup} question(s), {warmup_tokens} tokens)")
            attempt(system, lambda: system.run(prompts[:warmup], 1, warmup_tokens), "")
    for rnd in range(repeat):
        for c in concurrency:
            for system in [s for s in (systems if rnd % 2 == 0 else systems[::-1]) if s.name not in errors]:
                def one(system=system, c=c):
                    if system.before_run is not None:
                        system.before_run()
                    r = system.run(prompts, c, max_new_tokens)
                    runs.setdefault(system.name, {}).setdefault(c, []).append(r)
                    log(f"{system.name} c{c}{f' run {rnd + 1}/{repeat}' if repeat > 1 else ''}: {len(prompts)} "
                        f"questions, {len(r.hops)} hops, {sum(r.generated)} tokens, {r.wall_s:.1f} s")

                attempt(system, one, f" c{c}")
    return {name: {c: combine_runs(rs) for c, rs in by_c.items()} for name, by_c in runs.items()}, errors


# -- building the real systems -------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="out/synth/test.jsonl", help="a rig synth test.jsonl (corpus.jsonl beside it)")
    p.add_argument("--questions", "--limit", dest="questions", type=int, default=16)
    p.add_argument("--min-hops", type=int, default=2,
                   help="only questions whose gold answer needs at least this many hops (0: all)")
    p.add_argument("--search-ms", type=float, default=150.0, help="added to every search call")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--systems", help=f"comma-separated, of {','.join(SYSTEMS)} (default: every one available)")
    p.add_argument("--llama-server",
                   help="URL of a running llama-server serving the merged model (rig-llama, resubmit-llama)")
    p.add_argument("--config", help="YAML config (default: the embedded model with its marker adapter)")
    p.add_argument("--max-iterations", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="sampled tokens per answer (evidence not counted)")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's max_model_len")
    p.add_argument("--vllm-kv-gib", type=float, help="vLLM's KV cache in GiB (default: 1 on vLLM's CPU build)")
    p.add_argument("--warmup", type=int, default=1,
                   help="questions each system answers (8 tokens) before it is measured")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each system at each concurrency, interleaved; each figure is the median run's "
                        "(tokens/s) or over all runs' hops (per hop)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the table and the JSON line
    concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    wanted = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SYSTEMS]
    if unknown or not concurrency or min(concurrency) < 1:
        print(f"bench/peers.py: unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}"
              if unknown else "bench/peers.py: --concurrency needs positive integers", file=sys.stderr)
        return 2

    from rig_decode.config import RigConfig
    from rig_decode.prompt import build_prompt
    from rig_decode.retrieval.factory import build_retriever

    loaded = load_synth(args.dataset, "bench/peers.py")
    if loaded is None:
        return 2
    examples, corpus = loaded
    examples = [e for e in examples if (e.hops or 0) >= args.min_hops][: args.questions]
    if not examples:
        print(f"bench/peers.py: no question of {args.dataset} needs {args.min_hops} hops", file=sys.stderr)
        return 2
    base = RigConfig.from_yaml(args.config) if args.config else RigConfig()
    # no query-embedding cache: a round's later systems would skip the model (~15 ms a query on 2 cores)
    cfg = base.updated(rig={"max_iterations": args.max_iterations}, model={"max_tokens": args.max_tokens},
                       engine={"backend": "hf"}, retriever={"query_cache_size": 0})
    log(f"{len(examples)} questions; building the retriever over "
        f"{len(corpus) if corpus else 'the configured'} documents")
    retriever = SearchDelay(build_retriever(cfg.retriever, corpus=corpus), args.search_ms)

    model = tokenizer = None
    if "rig-hf" in wanted:
        from rig_decode.models.loader import load_model

        log(f"loading {cfg.model.name} in process")
        model, tokenizer = load_model(cfg.model)
    else:
        from rig_decode.models.loader import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    spec = MarkerSpec.from_style(cfg.rig.marker_style)
    prompts = [build_prompt(tokenizer, e.question, spec, cfg.system_prompt()) for e in examples]

    from rig_decode.engine import RigEngine
    from rig_decode.session import engine_options

    systems, skipped, cleanup = [], {}, []

    def rig_system(name, make_runner, opts_cfg, the_model=None, before=None):
        def build(c):
            runner = make_runner(c) if make_runner else None
            return RigEngine(the_model, tokenizer, retriever, engine_options(opts_cfg, the_model, max_batch_size=c),
                             runner=runner)

        return System(name, lambda p, c, n: run_rig(name, build, p, c, n), before)

    loop_kw = dict(max_iterations=cfg.rig.max_iterations, top_k=cfg.retriever.top_k,
                   evidence_budget=cfg.rig.evidence_token_budget, spec=spec)

    if "rig-hf" in wanted:
        systems.append(rig_system("rig-hf", None, cfg, model))

    vllm_names = [n for n in ("rig-vllm-stream", "vllm-alone", "rig-vllm-prefix", "resubmit-vllm") if n in wanted]
    if vllm_names:
        from rig_decode.engine.vllm_api import VllmMissingError, load_vllm_api

        try:
            api = load_vllm_api()
        except VllmMissingError as e:
            api = None
            for n in vllm_names:
                skipped[n] = f"vLLM missing: {e}"
        if api is not None:
            kv = args.vllm_kv_gib if args.vllm_kv_gib is not None else (1.0 if api.device == "cpu" else None)
            vcfg = cfg.updated(engine={"backend": "vllm", "vllm": {"max_model_len": args.max_model_len,
                                                                   "kv_cache_gib": kv}})
            if "rig-vllm-stream" in vllm_names and api.StreamingInput is None:
                skipped["rig-vllm-stream"] = f"vLLM {api.version} has no StreamingInput (resumable requests)"
                vllm_names.remove("rig-vllm-stream")
            if vllm_names:
                log(f"starting vLLM {api.version} ({api.device}) with {vcfg.model.name}")
                try:
                    built, stop_vllm = vllm_systems(vcfg, api, vllm_names, tokenizer, retriever, rig_system, loop_kw)
                    systems += built
                    cleanup.append(stop_vllm)
                except Exception as e:  # noqa: BLE001 - reported as skipped, the other systems still run
                    for n in vllm_names:
                        skipped[n] = f"vLLM engine did not start: {type(e).__name__}: {e}"

    llama_names = [n for n in ("rig-llama", "rig-llama-lookahead", "resubmit-llama") if n in wanted]
    for n in llama_names:
        if not args.llama_server:
            skipped[n] = "no --llama-server URL"
    if llama_names and args.llama_server:
        from rig_decode.engine.runner_remote import RemoteRunner
        from rig_decode.engine.servers import LlamaCppServer
        from rig_decode.engine.runner_stream import StreamingRunner

        probe = LlamaCppServer(args.llama_server)
        props = probe.get("/props")
        n_ctx = probe.context_limit()
        probe.close()
        if props is None:
            for n in llama_names:
                skipped[n] = f"no llama-server answers {args.llama_server}/props"
        else:
            rcfg = cfg.updated(engine={"backend": "remote",
                                       "remote": {"base_url": args.llama_server, "api": "llama.cpp"}})
            r = rcfg.engine.remote
            erase = erase_llama_slots(args.llama_server)
            if "rig-llama" in llama_names:
                systems.append(rig_system("rig-llama", lambda c: StreamingRunner(
                    LlamaCppServer(args.llama_server), len(tokenizer), top_logprobs=r.top_logprobs), rcfg,
                    before=erase))
            if "rig-llama-lookahead" in llama_names:
                systems.append(rig_system("rig-llama-lookahead", lambda c: RemoteRunner(
                    LlamaCppServer(args.llama_server), len(tokenizer), lookahead=r.lookahead,
                    top_logprobs=r.top_logprobs, parallel=max(c, r.parallel)), rcfg, before=erase))
            if "resubmit-llama" in llama_names:
                complete = LlamaCompleter(args.llama_server, parallel=max(concurrency))
                cleanup.append(complete.close)
                systems.append(System("resubmit-llama", lambda p, c, k: run_resubmit(
                    "resubmit-llama", complete, tokenizer, retriever, p, c, k,
                    context_limit=n_ctx or args.max_model_len, **loop_kw), erase))

    for n in wanted:
        if n not in skipped and n not in {s.name for s in systems}:
            skipped[n] = "not built"
    for n, why in skipped.items():
        log(f"{n}: skipped: {why}")
    try:
        runs, errors = measure(systems, prompts, concurrency, args.max_tokens, warmup=args.warmup,
                               repeat=args.repeat)
    finally:
        for fn in cleanup:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log(f"cleanup: {type(e).__name__}: {e}")
    summary = summarize(runs, [e.answers for e in examples])
    adapter = cfg.model.adapter
    result = result_json(summary, skipped, errors, concurrency, dataset=str(args.dataset), questions=len(examples),
                         min_hops=args.min_hops, search_ms=args.search_ms, max_iterations=cfg.rig.max_iterations,
                         max_tokens=args.max_tokens, repeat=args.repeat,
                         model=f"{cfg.model.name} (adapter: {adapter})",
                         search_calls=retriever.calls)
    print_report(result)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
