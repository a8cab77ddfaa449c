"""Request bodies of the OpenAI-compatible endpoints, and OpenAI's error schema.

Fields OpenAI clients commonly send that rig_decode does not implement (``user``,
``presence_penalty``, ``logit_bias``, ``response_format``, ``tools``...) are accepted and ignored;
``n > 1`` and ``logprobs`` are refused with a 400 that names them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is supported")
            v = v[0]
        return v


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error schema."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
