"""``RigSession(config).ask(question) -> (answer, trace)``: the public entry point."""

from __future__ import annotations

from pathlib import Path

from .config import RigConfig
from .gate import settings_from_config
from .memory import EvidenceMemory
from .engine.engine import EngineOptions, RigEngine
from .markers import MarkerSpec
from .prompt import build_prompt
from .retrieval.base import Retriever
from .trace import Trace


def engine_options(cfg: RigConfig, model=None, **overrides) -> EngineOptions:
    """Engine options from a config; ``model`` resolves ``engine.kv_budget: auto``."""
    budget = cfg.engine.kv_budget
    if budget == "auto":
        from .engine.kv import auto_kv_budget

        budget = auto_kv_budget(model) if model is not None else None
    opts = dict(
        max_iterations=cfg.rig.max_iterations,
        max_query_tokens=cfg.rig.max_query_tokens,
        evidence_token_budget=cfg.rig.evidence_token_budget,
        marker_style=cfg.rig.marker_style,
        top_k=cfg.retriever.top_k,
        retrieval_timeout_s=cfg.retriever.timeout_s,
        max_new_tokens=cfg.model.max_tokens,
        temperature=cfg.model.temperature,
        top_p=cfg.model.top_p,
        seed=cfg.model.seed,
        deadline_s=cfg.rig.deadline_s,
        newline_ends_query=cfg.rig.newline_ends_query,
        retrieve_first=cfg.rig.retrieve_first,
        max_batch_size=cfg.engine.max_batch_size,
        kv_budget_tokens=budget,
        retrieval_retries=cfg.engine.retrieval_retries,
        max_hung_searches=cfg.engine.max_hung_searches,
        sync_retrieval=cfg.engine.sync_retrieval,
        prefill_chunk_tokens=cfg.engine.prefill_chunk_tokens,
        decode_step=cfg.engine.decode_step,
        citations=cfg.rig.citations,
        gate=settings_from_config(cfg.rig.gate) if cfg.rig.gate.enabled else None,
        reuse_similarity=cfg.rig.reuse_similarity,
        append_format=cfg.rig.append_format,
        zero_prefill=cfg.engine.zero_prefill.enabled,
        zero_prefill_recompute=cfg.engine.zero_prefill.recompute,
        zero_prefill_select=cfg.engine.zero_prefill.select,
        chunk_store_bytes=cfg.engine.zero_prefill.store_mb << 20,
        chunk_store_host_bytes=cfg.engine.zero_prefill.host_store_mb << 20,
    )
    opts.update(overrides)
    return EngineOptions(**opts)


class RigSession:
    def __init__(self, config: RigConfig | str | Path | None = None, *, model=None, tokenizer=None,
                 retriever: Retriever | None = None, reprefill: bool = False):
        if config is None:
            config = RigConfig()
        elif not isinstance(config, RigConfig):
            config = RigConfig.from_yaml(config)
        self.config = config
        runner = None
        if config.engine.backend == "remote":
            from .engine.runner_stream import remote_runner
            from .models.loader import load_tokenizer

            tokenizer = tokenizer or load_tokenizer(config.served_model())
            model, runner = None, remote_runner(config.engine.remote, len(tokenizer))
        elif config.engine.backend == "vllm":
            from .engine.runner_vllm import vllm_runner
            from .engine.vllm_api import load_vllm_api
            from .models.loader import load_tokenizer

            api = load_vllm_api()  # before any model file is read: a missing vLLM fails first
            tokenizer = tokenizer or load_tokenizer(config.served_model())
            model, runner = None, vllm_runner(config, len(tokenizer), tokenizer=tokenizer, api=api)
        elif model is None or tokenizer is None:
            from .models.loader import load_model

            model, tokenizer = load_model(config.model)
        if retriever is None:
            from .retrieval.factory import build_retriever

            retriever = build_retriever(config.retriever)
        self.model, self.tokenizer, self.retriever = model, tokenizer, retriever
        self.spec = MarkerSpec.from_style(config.rig.marker_style)
        self.system = config.system_prompt()
        self.engine = RigEngine(model, tokenizer, retriever, engine_options(config, model, reprefill=reprefill),
                                runner=runner)

    def prompt_ids(self, question, memory: EvidenceMemory | None = None) -> list[int]:
        return build_prompt(self.tokenizer, question, self.spec, self.system,
                            memory.prompt_text() if memory else "")

    def ask(self, question) -> tuple[str, Trace]:
        """``question``: a string, or a chat as a list of ``{"role", "content"}`` messages."""
        return self.ask_batch([question])[0]

    def ask_batch(self, questions: list) -> list[tuple[str, Trace]]:
        """All questions decode as one batch; hops of every row go to the retriever together."""
        if not questions:
            return []
        seqs = [
            self.engine.new_sequence(self.prompt_ids(q), seq_id=i, question=q if isinstance(q, str) else "",
                                     raw=self.config.rig.show_markers)
            for i, q in enumerate(questions)
        ]
        self.engine.generate(seqs)
        return [(s.answer_text.strip(), s.trace) for s in seqs]

    def chat(self, messages: list[dict], memory: EvidenceMemory | None = None) -> tuple[str, Trace]:
        """Answer the last user message of a chat. With ``memory`` (one per conversation), the
        prompt carries the documents earlier turns retrieved, a near-duplicate query references
        them instead of searching again, and this turn's documents are remembered."""
        question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        seq = self.engine.new_sequence(self.prompt_ids(messages, memory), seq_id=0, question=question, memory=memory,
                                       raw=self.config.rig.show_markers)
        self.engine.generate([seq])  # the engine checks citations and tells memory this turn's documents
        return seq.answer_text.strip(), seq.trace

    def conversation(self) -> "Conversation":
        return Conversation(self)

    def close(self) -> None:
        """Stop the retrieval worker and the runner (vLLM's engine with it); idempotent."""
        self.engine.close()

    def __enter__(self) -> "RigSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Conversation:
    """A multi-turn chat with its own evidence memory: ``conv.ask(text) -> (answer, trace)``."""

    def __init__(self, session: RigSession):
        self.session, self.messages, self.memory = session, [], EvidenceMemory()

    def ask(self, text: str) -> tuple[str, Trace]:
        self.messages.append({"role": "user", "content": text})
        answer, trace = self.session.chat(self.messages, self.memory)
        self.messages.append({"role": "assistant", "content": answer})
        return answer, trace
