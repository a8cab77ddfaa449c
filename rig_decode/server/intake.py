"""What a request must pass before the engine sees it: its size, its key, and its text as tokens.

Everything here treats the client as a stranger:

- **Bounded before any work.** A body past ``server.max_request_bytes`` gets a 413 before it is
  read whole (``limited_receive``); text longer than the context could hold is refused before it is
  tokenised (``Prompts.check_size``); tokenising and prompt building run on threads, never on the
  event loop, and a big prompt takes a lane of its own, so a heavy request delays neither
  ``/health`` nor another client's prompt.
- **Text is text.** Message contents and text prompts are encoded with their special-token strings
  split as text (``prompt.text_ids``): only the chat template, the server's system prompt and the
  engine write control tokens. A token-id prompt is the one way a client passes ids; they must be
  in the vocabulary, and its marker tokens are counted in the trace as the client's own.
- **Keys with their own space** (``Keys``): each key has a name (what metrics and memories are
  labelled by, never the key) and optionally a namespace and filters its searches are held to.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..config import ConfigError, ServerConfig
from ..engine.engine import RigEngine
from ..markers import MarkerSpec
from ..prompt import build_prompt, text_ids
from .schemas import ChatCompletionRequest, GenerationRequest, error_body

_HEAVY_CHARS = 32_768
"""Prompts with more characters are built on the heavy lane (one thread), the rest on the light one."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers


# -- keys ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who sent a request: its key's name and the filters its searches are held to."""

    name: str
    filters: dict | None = None


ANONYMOUS = Tenant("anonymous")
"""Every request of a server without keys."""


class Keys:
    """``server.api_key`` (named ``default``) and ``server.api_keys``; none: no authentication."""

    def __init__(self, cfg: ServerConfig):
        self.keys: list[tuple[bytes, Tenant]] = []
        for k in cfg.api_keys:
            secret = k.key or os.environ.get(k.key_env or "", "")
            if len(secret) < 8:
                raise ConfigError(f"server.api_keys {k.name!r}: environment variable {k.key_env} is unset or "
                                  "shorter than 8 characters")
            filters = {**k.filters, **({"namespace": k.namespace} if k.namespace else {})}
            self.keys.append((secret.encode(), Tenant(k.name, filters or None)))
        if cfg.api_key:
            self.keys.append((cfg.api_key.encode(), Tenant("default")))

    def authenticate(self, authorization: str) -> Tenant:
        if not self.keys:
            return ANONYMOUS
        given = authorization.removeprefix("Bearer ").encode() if authorization.startswith("Bearer ") else b""
        found = None
        for secret, tenant in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(given, secret):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           "authentication_error", "invalid_api_key")
        return found


# -- the body's size -------------------------------------------------------------------------------


DRAIN_BYTES = 64 * 2**20
"""After a 413, the rest of a body up to this is read and dropped, so that a client that writes the
whole body before it reads finds the answer instead of a reset connection."""


async def limited_receive(scope, receive, send, limit: int, on_refused=None):
    """The ``receive`` an app may read a request with, or None when the body is past ``limit``
    bytes (a 413 in OpenAI's error schema is sent, at once when its Content-Length says so, else
    as soon as that many bytes have come) or the client went away. A body without a length is
    read here, up to the limit, and replayed whole."""
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None:
        if length.isdigit() and int(length) <= limit:
            return receive
        return await _refuse(receive, send, limit, int(length) if length.isdigit() else None, on_refused, scope)
    if scope.get("method") in ("GET", "HEAD"):
        return receive
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return await _refuse(receive, send, limit, None, on_refused, scope)
        if not message.get("more_body"):
            break
    body, replayed = b"".join(chunks), False

    async def replay():
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(receive, send, limit: int, length: int | None, on_refused, scope) -> None:
    if on_refused:
        on_refused(scope)
    size = f"{length:,} bytes" if length is not None else "longer"
    payload = json.dumps(error_body(f"the request body is {size}; this server takes at most {limit:,} "
                                    "(server.max_request_bytes)", "invalid_request_error",
                                    "request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": True})
    drained = 0
    while drained < DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            break
        drained += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.body", "body": b""})
    return None


# -- prompts ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    question: str
    """What the retrieval gate and the trace call the question (the last user message's text)."""
    marker_tokens: int = 0
    """Marker delimiter tokens in a token-id prompt (the client's own)."""


class Prompts:
    """Requests' prompts as token ids, built off the event loop."""

    def __init__(self, engine: RigEngine, cfg: ServerConfig, spec: MarkerSpec, system: str):
        # a copy of its own: a fast tokenizer flips a shared flag on the Rust side whenever a call
        # asks for other split_special_tokens than the last one, which must not race the engine's
        self.engine, self.tok, self.spec, self.system = engine, copy.deepcopy(engine.tokenizer), spec, system
        self.vocab_size = len(self.tok)
        table = engine.vocab.token_bytes
        self.max_chars = cfg.max_prompt_chars or engine.runner.context_limit * max(map(len, table))
        delimiters = {s.encode() for s in (*spec.start, *spec.end)}
        self.marker_ids = frozenset(t for t, b in enumerate(table) if b in delimiters)
        self.light = ThreadPoolExecutor(2, thread_name_prefix="rig-prompt")
        self.heavy = ThreadPoolExecutor(1, thread_name_prefix="rig-prompt-heavy")

    def check_size(self, req: GenerationRequest) -> int:
        """The request's characters of text; past ``max_chars`` a 400, before any tokenising."""
        chars = _chars(req)
        if chars > self.max_chars:
            raise ApiError(400, f"the prompt is {chars:,} characters, more than this model's context of "
                                f"{self.engine.runner.context_limit} tokens can hold (server.max_prompt_chars "
                                f"{self.max_chars:,})", code="context_length_exceeded",
                           param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        return chars

    async def build(self, req: GenerationRequest, memory_text: str = "") -> Prompt:
        chars = self.check_size(req) + len(memory_text)
        lane = self.heavy if chars > _HEAVY_CHARS else self.light
        return await asyncio.get_running_loop().run_in_executor(lane, self._build, req, memory_text)

    def _build(self, req: GenerationRequest, memory_text: str) -> Prompt:
        if isinstance(req, ChatCompletionRequest):
            try:
                messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                            for m in req.messages]
                ids = build_prompt(self.tok, messages, self.spec, self.system, memory_text)
            except Exception as e:  # noqa: BLE001 - e.g. the chat template rejects the role order
                raise ApiError(400, f"cannot build the prompt from these messages: {e}", param="messages") from None
            users = [m for m in req.messages if m.role == "user"]
            return Prompt(ids, users[-1].text() if users else "")
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            return Prompt(text_ids(self.tok, req.prompt), req.prompt)
        bad = [i for i in req.prompt if i >= self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0 to {self.vocab_size - 1})",
                           param="prompt")
        return Prompt(list(req.prompt), self.tok.decode(req.prompt, skip_special_tokens=True),
                      sum(i in self.marker_ids for i in req.prompt))

    def close(self) -> None:
        self.light.shutdown(wait=False, cancel_futures=True)
        self.heavy.shutdown(wait=False, cancel_futures=True)


def _chars(req: GenerationRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(m.chars() for m in req.messages)
    return len(req.prompt) if isinstance(req.prompt, str) else 0
