"""The ``rig`` command: ``rig ask``, ``rig demo``, ``rig models pull``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources

DEMO_QUESTIONS = "demo_questions.json"


def _quiet_hf() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
    return cfg.updated(rig=rig, model=model) if rig or model else cfg


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
        print(f"  hop {step.round}: {step.query!r} -> {docs}; {step.latency_ms:.0f} ms search, "
              f"{step.evidence_tokens} evidence tokens spliced in {step.splice_ms:.0f} ms{err}", file=out)
    print(f"  {trace.num_hops} hops, {trace.generated_tokens} tokens generated, "
          f"{trace.evidence_tokens} evidence tokens, {trace.total_ms / 1e3:.1f}s, finish: {trace.finish_reason}",
          file=out)


def cmd_ask(args) -> int:
    if not args.question.strip():
        raise ValueError("empty question")
    session = _session(args)
    answer, trace = session.ask(args.question)
    if args.json:
        print(json.dumps({"answer": answer, "trace": trace.to_dict()}, ensure_ascii=False))
    else:
        print(answer)
        _print_hops(trace)
    return 0


def cmd_demo(args) -> int:
    questions = json.loads((resources.files("rig_decode") / "data" / DEMO_QUESTIONS).read_text())
    session = _session(args)
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

    ask = sub.add_parser("ask", help="answer one question, retrieving as the model asks")
    ask.add_argument("question")
    ask.add_argument("--json", action="store_true", help='print one JSON object {"answer", "trace"}')
    common(ask)
    ask.set_defaults(func=cmd_ask)

    demo = sub.add_parser("demo", help="answer the demo's multi-hop questions over the bundled knowledge base")
    common(demo)
    demo.set_defaults(func=cmd_demo)

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

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, RetrievalError, ValueError, RuntimeError) as e:
        print(f"rig: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
