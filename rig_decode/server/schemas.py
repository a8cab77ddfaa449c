"""Request bodies of the OpenAI-compatible endpoints, the ``rig`` extension of responses, and
OpenAI's error schema.

Fields OpenAI clients commonly send that rig_decode does not implement (``user``,
``presence_penalty``, ``logit_bias``, ``response_format``, ``tools``...) are accepted and ignored;
``n > 1`` and ``logprobs`` are refused with a 400 that names them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ..trace import RetrievalStep, Trace


class RigOptions(BaseModel):
    """The ``rig`` extension of a request body: per-request overrides."""

    model_config = ConfigDict(extra="forbid")
    max_iterations: int | None = Field(None, ge=0, le=16)
    top_k: int | None = Field(None, ge=1, le=50)
    retrieval: bool = True
    """False: answer without retrieval (no hop can start)."""
    show_evidence: bool = False
    """True: ``content`` is the raw completion, markers and evidence blocks included."""
    conversation_id: str | None = Field(None, min_length=1, max_length=128)
    """Requests with the same id share an evidence memory: earlier turns' documents are in the
    prompt and near-duplicate queries are not searched again."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for p in self.content:
                if p.get("type") != "text":
                    raise ValueError(f"content parts of type {p.get('type')!r} are not supported (text only)")
                parts.append(str(p.get("text", "")))
            return "".join(parts)
        return self.content or ""

    def chars(self) -> int:
        """The content's length in characters (``text`` without building it, nor failing)."""
        if isinstance(self.content, list):
            return sum(len(str(p.get("text", ""))) for p in self.content if isinstance(p, dict))
        return len(self.content or "")


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1)
    logprobs: bool | int | None = None
    rig: RigOptions = RigOptions()

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    """Text, or token ids (the one way a client passes ids: a chat's content and a text prompt are
    encoded as text, their special-token strings included). One prompt per request."""

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and not isinstance(v[0], int):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and (not v or min(v) < 0):
            raise ValueError("a token-id prompt needs at least one id, none negative")
        return v


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error schema."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def hop_json(step: RetrievalStep) -> dict:
    return {"round": step.round, "query": step.query,
            "docs": [{"id": d.id, "title": d.title, "score": round(d.score, 4), "source": d.source}
                     for d in step.docs],
            "latency_ms": round(step.latency_ms, 1), "splice_ms": round(step.splice_ms, 1),
            "evidence_tokens": step.evidence_tokens, "batch_size": step.batch_size,
            "fallback": step.fallback, "error": step.error, "info": step.info}


def rig_json(trace: Trace) -> dict:
    """The ``rig`` extension object (a finished request's trace: citations checked by the engine)."""
    timings = {k: round(getattr(trace, k), 1) for k in
               ("queue_ms", "ttft_ms", "decode_ms", "retrieval_ms", "parked_ms", "splice_ms", "total_ms")}
    return {"hops": [hop_json(s) for s in trace.retrieval_steps], "num_hops": trace.num_hops,
            "evidence_tokens": trace.evidence_tokens, "prompt_marker_tokens": trace.prompt_marker_tokens,
            "finish_reason": trace.finish_reason,
            "marker_errors": list(trace.marker_errors), "engine_errors": list(trace.engine_errors),
            "timings": timings, "gate": list(trace.gate),
            "citations": list(trace.citations)}


def usage_json(trace: Trace) -> dict:
    return {"prompt_tokens": trace.prompt_tokens, "completion_tokens": trace.generated_tokens,
            "total_tokens": trace.prompt_tokens + trace.generated_tokens}
