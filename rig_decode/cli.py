"""The ``rig`` command: ask, demo, serve, index (build | delete | stats), eval, synth, plan and
models pull; ``rig COMMAND --help`` gives each one's options."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from importlib import resources

DEMO_QUESTIONS = "demo_questions.json"


def _quiet_hf() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # --backend vllm: no per-start config dump, and nothing of vLLM's on stdout (the answer, --json)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _load_config(args):
    from .config import RigConfig

    cfg = RigConfig.from_yaml(args.config) if args.config else RigConfig()
    rig, model = {}, {}
    if getattr(args, "max_iterations", None) is not None:
        rig["max_iterations"] = args.max_iterations
    if getattr(args, "show_markers", False):
        rig["show_markers"] = True
    if getattr(args, "max_tokens", None) is not None:
        model["max_tokens"] = args.max_tokens
    engine = {}
    if getattr(args, "backend", None):
        engine["backend"] = args.backend
    if getattr(args, "base_url", None):
        engine["remote"] = {**cfg.engine.remote.model_dump(), "base_url": args.base_url}
    sections = {k: v for k, v in (("rig", rig), ("model", model), ("engine", engine)) if v}
    return cfg.updated(**sections) if sections else cfg


def _session(args):
    from .session import RigSession

    _quiet_hf()
    t0 = time.perf_counter()
    session = RigSession(_load_config(args))
    print(f"[rig] loaded {session.config.model.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return session


def _print_hops(trace, out=sys.stdout) -> None:
    for step in trace.retrieval_steps:
        docs = ", ".join(f"{d.title or d.id} ({d.score:.2f})" for d in step.docs) or "no documents"
        err = f"  [{step.error}]" if step.error else ""
        served = step.info.get("server")
        server = (f"; the server took {served['cache_n']} tokens from its cache and evaluated {served['prompt_n']}"
                  if served and served.get("prompt_n") is not None else "")
        print(f"  hop {step.round}: {step.query!r} -> {docs}; {step.latency_ms:.0f} ms search, "
              f"{step.evidence_tokens} evidence tokens spliced in {step.splice_ms:.0f} ms{server}{err}", file=out)
    print(f"  {trace.num_hops} hops, {trace.generated_tokens} tokens generated, "
          f"{trace.evidence_tokens} evidence tokens, {trace.total_ms / 1e3:.1f}s, finish: {trace.finish_reason}",
          file=out)


def cmd_ask(args) -> int:
    if not args.question.strip():
        raise ValueError("empty question")
    with _session(args) as session:
        answer, trace = session.ask(args.question)
    if args.json:
        print(json.dumps({"answer": answer, "trace": trace.to_dict()}, ensure_ascii=False))
    else:
        print(answer)
        _print_hops(trace)
    return 0


def cmd_demo(args) -> int:
    questions = json.loads((resources.files("rig_decode") / "data" / DEMO_QUESTIONS).read_text())
    with _session(args) as session:
        print(f"Demo knowledge base: Helios Gateway changelogs, release approvals, contracts "
              f"({len(session.retriever.docs)} documents).\n")
        results = session.ask_batch([q["question"] for q in questions])
    for q, (answer, trace) in zip(questions, results):
        print(f"Q: {q['question']}")
        print(f"A: {answer}")
        print(f"   (expected: {q['answer']})")
        _print_hops(trace)
        print()
    return 0


def cmd_eval_conversations(args) -> int:
    from .eval import conversations as C
    from .models.loader import load_model
    from .retrieval.factory import build_retriever
    from .retrieval.ingest import load_documents

    convs = C.load_conversations(args.dataset, args.limit)
    corpus_path = Path(args.dataset).parent / "corpus.jsonl"
    corpus = load_documents(corpus_path) if corpus_path.is_file() else None
    cfg = _load_config(argparse.Namespace(config=args.config, max_tokens=args.max_tokens))
    _quiet_hf()
    model, tokenizer = load_model(cfg.model)
    retriever = build_retriever(cfg.retriever, corpus=corpus)
    methods = [m.strip() for m in (args.methods or ",".join(C.METHODS)).split(",") if m.strip()]
    results = C.run_conversations(cfg, model, tokenizer, retriever, convs, methods, args.batch_size,
                                  progress=not args.no_progress)
    summary = {m: C.aggregate(r["records"]) | {"wall_s": r["wall_s"]} for m, r in results.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "traces.jsonl").open("w", encoding="utf-8") as f:
        for m, r in results.items():
            for rec in r["records"]:
                f.write(json.dumps({"method": m, **rec}, ensure_ascii=False) + "\n")
    meta = {"dataset": str(args.dataset), "model": cfg.model.name, "conversations": len(convs),
            "command": "rig " + shlex.join(args.argv)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": summary}, indent=2) + "\n")
    report = f"# Multi-turn evaluation\n\n    {meta['command']}\n\n{C.table(summary)}"
    (out / "report.md").write_text(report)
    print(C.table(summary))
    if args.json:
        print(json.dumps({"runs": summary}))
    return 0


def cmd_eval(args) -> int:
    if args.conversations:
        return cmd_eval_conversations(args)
    from .eval.datasets import load_dataset
    from .eval.report import hops_table, markdown_table, write_outputs
    from .eval.runner import EvalRunner, plan
    from .models.loader import load_model
    from .retrieval.factory import build_retriever

    keys = plan([m.strip() for m in (args.methods or "none,rag,rig,rig-reprefill").split(",") if m.strip()],
                [int(x) for x in args.max_iterations.split(",")],
                [int(x) for x in args.reference_iterations.split(",")] if args.reference_iterations else None)
    examples, corpus = load_dataset(args.dataset, args.limit)
    cfg = _load_config(argparse.Namespace(config=args.config, max_tokens=args.max_tokens))
    _quiet_hf()
    model, tokenizer = load_model(cfg.model)
    retriever = build_retriever(cfg.retriever, corpus=corpus)
    print(f"[rig] eval: {len(examples)} questions, {len(retriever.docs)} documents, runs: "
          f"{', '.join(k.label for k in keys)}", file=sys.stderr)
    runner = EvalRunner(cfg, model, tokenizer, retriever, batch_size=args.batch_size, progress=not args.no_progress)
    results = runner.run(examples, keys)
    meta = {"dataset": str(args.dataset), "model": cfg.model.name, "examples": len(examples),
            "corpus": f"{len(retriever.docs)} documents", "batch_size": args.batch_size,
            "max_tokens": cfg.model.max_tokens, "command": "rig " + shlex.join(args.argv)}
    data = write_outputs(args.out, results, keys, meta)
    print(markdown_table(data["runs"]))
    print()
    print(hops_table(data["runs"]))
    for mi, c in data["rig_vs_reprefill"].items():
        print(f"\nrig vs rig-reprefill @ max_iterations={mi}: identical answers: {c['identical_answers']}, "
              f"rig {c['speedup']:.2f}x faster")
    for label, c in data["variants_vs_rig"].items():
        print(f"{label} vs rig: {100 * c['same_answers']:.1f}% identical answers, "
              f"accuracy {100 * c['accuracy_delta']:+.1f} points")
    print(f"\nwrote {args.out}/report.md, results.json, traces.jsonl and plots", file=sys.stderr)
    if args.json:
        print(json.dumps({k: data[k] for k in ("runs", "rig_vs_reprefill", "variants_vs_rig")}))
    return 0


def cmd_plan(args) -> int:
    from .engine.kv import plan_memory

    options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "argv", "json", "model_flag")}
    plan = plan_memory(**options | {"model": args.model or args.model_flag})
    print(json.dumps(plan.to_dict()) if args.json else plan.table())
    return 0 if plan.fits else 1


def cmd_synth(args) -> int:
    if args.generator == "wide":
        from .eval.worlds import write
    else:
        from .eval.synth import write

    extra = {k: True for k in ("extra_phrasings", "extra_no_search") if getattr(args, k)}
    if extra and args.generator != "wide":
        raise SystemExit(f"rig synth: --{next(iter(extra)).replace('_', '-')} needs --generator wide")
    counts = write(args.out, seed=args.seed, scale=args.scale, **extra)
    print(json.dumps(counts))
    return 0


def _embedder(args):
    from .retrieval.dense import Embedder

    cfg = _load_config(argparse.Namespace(config=args.config))
    return Embedder(cfg.retriever.embedding_model)


def cmd_index_build(args) -> int:
    from .retrieval.ingest import Chunking, build_index, chunk_document, read_folder

    _quiet_hf()
    docs = read_folder(args.input)
    print(f"[rig] read {len(docs)} documents from {args.input}", file=sys.stderr)
    embedder = _embedder(args)
    chunking = Chunking(args.words, args.chars, args.overlap)
    if args.milvus_uri:
        from .retrieval.milvus import MilvusRetriever

        chunks = [c for d in docs for c in chunk_document(d, chunking)]
        if args.namespace:
            for c in chunks:
                c.metadata["namespace"] = args.namespace
        store = MilvusRetriever(args.milvus_uri, args.collection, embedder, create_if_missing=True)
        store.upsert(chunks, embedder.encode([c.embed_text() for c in chunks], progress=True))
        report = {"milvus": args.milvus_uri, "collection": args.collection, "chunks": len(chunks)}
    else:
        report = build_index(docs, embedder, args.out, chunking, args.namespace, replace=args.replace)
    print(json.dumps(report))
    return 0


def cmd_index_delete(args) -> int:
    from .retrieval.ingest import build_index

    _quiet_hf()
    print(json.dumps(build_index([], _embedder(args), args.index, delete=args.ids)))
    return 0


def cmd_index_stats(args) -> int:
    from .retrieval.store import IndexStore

    print(json.dumps(IndexStore.load(args.index).stats(), indent=1))
    return 0


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from .server import create_app
    except ImportError as e:
        print(f"rig serve needs the server extra: pip install 'rig_decode[server]' ({e})", file=sys.stderr)
        return 2
    _quiet_hf()
    cfg = _load_config(args)
    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if server:
        cfg = cfg.updated(server=server)
    t0 = time.perf_counter()
    app = create_app(cfg)
    print(f"[rig] loaded {cfg.model.name} in {time.perf_counter() - t0:.1f}s; "
          f"serving on http://{cfg.server.host}:{cfg.server.port}/ (playground at /)", file=sys.stderr)
    uvicorn.run(app, host=cfg.server.host, port=cfg.server.port, log_level="warning")
    return 0


def cmd_models_pull(args) -> int:
    from .models.embedded import pull

    _quiet_hf()
    print(pull(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rig", description="Retrieval-interleaved decoding with KV-cache splicing.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--config", help="YAML config (defaults: embedded model and demo knowledge base)")
        sp.add_argument("--max-iterations", type=int, help="hop budget (overrides rig.max_iterations)")
        sp.add_argument("--max-tokens", type=int, help="tokens to generate (overrides model.max_tokens)")
        sp.add_argument("--show-markers", action="store_true", help="keep marker and evidence text in the answer")

    def backend(sp):
        sp.add_argument("--backend", choices=["hf", "remote", "vllm"],
                        help="where the model runs (overrides engine.backend)")
        sp.add_argument("--base-url", help="the completion server of --backend remote (engine.remote.base_url)")

    ask = sub.add_parser("ask", help="answer one question, retrieving as the model asks")
    ask.add_argument("question")
    ask.add_argument("--json", action="store_true", help='print one JSON object {"answer", "trace"}')
    backend(ask)
    common(ask)
    ask.set_defaults(func=cmd_ask)

    demo = sub.add_parser("demo", help="answer the demo's multi-hop questions over the bundled knowledge base")
    backend(demo)
    common(demo)
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="evaluate methods (none, rag, rig, rig-reprefill, rig-summary, "
                                     "rig-zero-prefill, rig-zero-prefill-deviation) on a dataset")
    ev.add_argument("--dataset", required=True, help="JSONL (our format) or HotpotQA-style JSON/JSONL")
    ev.add_argument("--config", help="YAML config")
    ev.add_argument("--methods", help="default none,rag,rig,rig-reprefill; with --conversations "
                                       "rig,rig+memory,rig+memory+gate")
    ev.add_argument("--conversations", action="store_true",
                    help="the dataset holds multi-turn conversations (rig synth's conversations-*.jsonl)")
    ev.add_argument("--max-iterations", default="1,2,3", help="comma-separated hop budgets for the rig methods")
    ev.add_argument("--reference-iterations", help="run rig-reprefill only at these hop budgets (default: all)")
    ev.add_argument("--limit", type=int, help="first N questions only")
    ev.add_argument("--max-tokens", type=int, help="tokens to generate per answer (overrides model.max_tokens)")
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--out", required=True, help="output directory")
    ev.add_argument("--json", action="store_true", help="last stdout line: one JSON object with the metrics")
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plan", help="what a GPU holds serving a model, part by part: its margin and KV budget")
    pl.add_argument("model", nargs="?", help="qwen2.5-32b, HF id or config.json (24GiB, nf4, 8192 x 1, chunk 512)")
    pl.add_argument("--model", dest="model_flag", help=argparse.SUPPRESS)
    for name in ("gpu_mem", "quantization", "dtype", "kv_dtype", "context", "sequences", "prefill_chunk",
                 "index_vectors", "index_dim", "index_scratch", "outside_torch"):  # sizes as text: plan_memory parses
        pl.add_argument("--" + name.replace("_", "-"), default=argparse.SUPPRESS,
                        type=int if name in ("context", "sequences", "index_vectors", "index_dim") else str)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    syn = sub.add_parser("synth", help="write the synthetic multi-hop benchmark (corpus + train/dev/test)")
    syn.add_argument("--out", required=True)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--scale", type=float, default=1.0)
    syn.add_argument("--generator", choices=("products", "wide"), default="products",
                     help="products: five relations over products, makers, founders, cities, countries; wide: 40 "
                          "relations over nine kinds with transfer splits (unseen entities, phrasings, relations)")
    syn.add_argument("--extra-phrasings", action="store_true",
                     help="wide: the train and dev worlds also use the training-only fact and question phrasings "
                          "(more training data; the test worlds are then no benchmark: use --held-out on them)")
    syn.add_argument("--extra-no-search", action="store_true",
                     help="wide: the train world also asks a hundred more general-knowledge questions that need no "
                          "search (EXTRA_COMMON; disjoint from the dev and test worlds' lists)")
    syn.set_defaults(func=cmd_synth)

    index = sub.add_parser("index", help="build, update and inspect retrieval indexes")
    isub = index.add_subparsers(dest="index_command", required=True)
    build = isub.add_parser("build", help="index a folder of .md/.txt/.jsonl documents (incremental by id)")
    build.add_argument("--input", required=True, help="a folder or a file")
    build.add_argument("--out", help="index directory (created, or updated in place atomically)")
    build.add_argument("--config", help="YAML config (its retriever.embedding_model is used)")
    build.add_argument("--words", type=int, default=200, help="words per chunk (non-CJK text)")
    build.add_argument("--chars", type=int, default=400, help="characters per chunk (CJK text)")
    build.add_argument("--overlap", type=float, default=0.15, help="fraction of a chunk repeated in the next")
    build.add_argument("--namespace", help="tag every chunk with this namespace (filter on it at search time)")
    build.add_argument("--replace", action="store_true", help="rebuild from scratch instead of updating")
    build.add_argument("--milvus-uri", help="load into Milvus instead (a .db file for Milvus Lite, or a server URI)")
    build.add_argument("--collection", default="rig_decode")
    build.set_defaults(func=cmd_index_build)
    delete = isub.add_parser("delete", help="remove documents by id")
    delete.add_argument("--index", required=True)
    delete.add_argument("--config")
    delete.add_argument("ids", nargs="+")
    delete.set_defaults(func=cmd_index_delete)
    stats = isub.add_parser("stats", help="documents, chunks, dimension, metadata fields of an index")
    stats.add_argument("index")
    stats.set_defaults(func=cmd_index_stats)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming, metrics and a playground")
    serve.add_argument("--config", help="YAML config")
    serve.add_argument("--host", help="default: server.host (127.0.0.1)")
    serve.add_argument("--port", type=int, help="default: server.port (8000)")
    backend(serve)
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="manage embedded models")
    msub = models.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="fetch and convert an embedded model into the cache (offline of any hub)")
    pull.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    pull.set_defaults(func=cmd_models_pull)
    return p


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .models.loader import ModelLoadError
    from .retrieval.base import RetrievalError

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    if getattr(args, "index_command", None) == "build" and not (args.out or args.milvus_uri):
        print("rig: error: index build needs --out (or --milvus-uri)", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, RetrievalError, ValueError, RuntimeError) as e:
        print(f"rig: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
