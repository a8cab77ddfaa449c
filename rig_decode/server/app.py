"""A thin OpenAI-compatible HTTP front for the engine.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream``
as Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /health``,
``GET /metrics`` (Prometheus), and the playground page at ``/``.

All the decoding happens in ``AsyncRigEngine``; this module only turns requests into sequences
and events into OpenAI's JSON. What OpenAI's schema has no field for goes into a ``rig`` object
(hops with queries, documents, scores and timings; evidence tokens): on the response, and in
streaming as extra chunks with no ``choices`` that OpenAI clients skip. Errors use OpenAI's error
schema. A client that goes away cancels its request in the engine.
"""

from __future__ import annotations

import asyncio
import html
import json
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import RigConfig
from ..engine.async_engine import AsyncRigEngine, FinishEvent, HopEvent, RequestHandle, TokenEvent
from ..engine.engine import RigEngine
from ..markers import MarkerSpec
from ..memory import EvidenceMemory
from ..trace import RetrievalStep
from .intake import ApiError, Keys, Prompts, Tenant, limited_receive
from .metrics import Metrics
from .schemas import (ChatCompletionRequest, CompletionRequest, GenerationRequest, error_body, hop_json, rig_json,
                      usage_json)

# The engine's finish reasons, in OpenAI's vocabulary (the exact one is in ``rig.finish_reason``).
_FINISH = {"stop": "stop", "length": "length", "context_full": "length", "deadline": "length",
           "cancelled": "stop", "error": "stop"}


@dataclass(slots=True)
class Update:
    """One piece of a request's progress: answer ``text``, a finished ``hop``, or the ``finish`` reason."""

    text: str = ""
    hop: RetrievalStep | None = None
    finish: str | None = None


class Server:
    """The state behind the routes: one engine, its async front, the metrics, the keys."""

    def __init__(self, config: RigConfig, engine: RigEngine):
        self.config, self.engine = config, engine
        self.metrics = Metrics(engine)
        self.front = AsyncRigEngine(engine)
        self.model_id = config.server.model_name or Path(config.model.name).name
        self.keys = Keys(config.server)
        self.prompts = Prompts(engine, config.server, MarkerSpec.from_style(config.rig.marker_style),
                               config.system_prompt())
        self.created = int(time.time())
        self.memories: OrderedDict[tuple[str, str], EvidenceMemory] = OrderedDict()
        self.preparing = 0
        """Requests whose prompt is being built (they count toward ``max_concurrency``)."""

    MAX_CONVERSATIONS = 1024
    """Per key: one key's conversations never push out another's."""

    def memory(self, tenant: Tenant, conversation_id: str | None) -> EvidenceMemory | None:
        """The conversation's evidence memory, the key's own: another key's same id is another
        conversation. Kept (``remember``) once a request with it is admitted."""
        if conversation_id is None:
            return None
        return self.memories.get((tenant.name, conversation_id)) or EvidenceMemory()

    def remember(self, tenant: Tenant, conversation_id: str, memory: EvidenceMemory) -> None:
        """Keep a conversation's memory, forgetting the key's least recently used one past the cap."""
        key = (tenant.name, conversation_id)
        self.memories.pop(key, None)
        self.memories[key] = memory
        own = [k for k in self.memories if k[0] == tenant.name]
        for k in own[: max(0, len(own) - self.MAX_CONVERSATIONS)]:
            del self.memories[k]

    # -- requests -> sequences ---------------------------------------------------------------------

    def check_auth(self, request: Request) -> Tenant:
        tenant = self.keys.authenticate(request.headers.get("authorization", ""))
        request.state.key = tenant.name
        return tenant

    def count_finished(self) -> None:
        """Metrics for the requests the engine finished since the last call (done at every submit
        and scrape, so the engine's list of them stays short)."""
        for seq in self.front.take_finished():
            self.metrics.observe(seq.trace)

    async def submit(self, req: GenerationRequest, tenant: Tenant) -> RequestHandle:
        self.count_finished()
        if req.model != self.model_id:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {self.model_id!r}",
                           code="model_not_found", param="model")
        in_flight = self.front.num_active + self.preparing
        if in_flight >= self.config.server.max_concurrency:
            raise ApiError(429, f"server busy: {in_flight} requests in flight "
                                f"(server.max_concurrency = {self.config.server.max_concurrency}); retry later",
                           "rate_limit_error", "overloaded", headers={"Retry-After": "1"})
        if isinstance(req, CompletionRequest) and req.rig.conversation_id is not None:
            raise ApiError(400, "rig.conversation_id needs /v1/chat/completions (a completion prompt has no place "
                                "for the conversation's evidence)", param="rig.conversation_id")
        memory = self.memory(tenant, req.rig.conversation_id)
        self.preparing += 1
        try:
            prompt = await self.prompts.build(req, memory.prompt_text() if memory else "")
        finally:
            self.preparing -= 1
        ids = prompt.ids
        limit = self.engine.runner.context_limit
        max_new = req.token_limit or self.config.model.max_tokens
        if len(ids) + max_new > limit:
            if req.token_limit is not None or len(ids) >= limit:
                raise ApiError(400, f"this model's maximum context length is {limit} tokens; the prompt is "
                                    f"{len(ids)} tokens and max_tokens is {max_new}",
                               code="context_length_exceeded", param="messages")
            max_new = limit - len(ids)
        hops = 0 if not req.rig.retrieval else req.rig.max_iterations
        try:
            handle = self.front.submit(ids, question=prompt.question, max_new_tokens=max_new,
                                       max_iterations=hops, top_k=req.rig.top_k, temperature=req.temperature,
                                       top_p=req.top_p, seed=req.seed, memory=memory, stop=req.stop,
                                       raw=req.rig.show_evidence, filters=tenant.filters)
        except ValueError as e:  # prompt too long for the context or the KV budget
            raise ApiError(400, str(e), code="context_length_exceeded") from None
        handle.seq.trace.prompt_marker_tokens = prompt.marker_tokens
        if memory is not None:
            self.remember(tenant, req.rig.conversation_id, memory)
        return handle

    # -- events -> OpenAI JSON ---------------------------------------------------------------------

    async def updates(self, handle: RequestHandle):
        """A request's progress as ``Update``s: new answer text, a hop that finished, or the end
        (the engine finished the request: stop strings, citations and memory included). Leaving
        early (the client went away) cancels the request."""
        finished = False
        try:
            async for ev in handle:
                if isinstance(ev, TokenEvent):
                    if ev.text:
                        yield Update(text=ev.text)
                elif isinstance(ev, HopEvent):
                    yield Update(hop=ev.step)
                elif isinstance(ev, FinishEvent):
                    finished = True
                    if ev.text:
                        yield Update(text=ev.text)
                    yield Update(finish=_FINISH.get(ev.reason, "stop"))
                    return
        finally:
            if not finished:
                handle.cancel()

    def close(self) -> None:
        self.front.close()
        self.prompts.close()


def create_app(config: RigConfig | None = None, *, engine: RigEngine | None = None) -> FastAPI:
    """The app; ``engine``: an engine to serve (default: one built from ``config``)."""
    config = config or RigConfig()
    if engine is None:
        from ..session import RigSession

        engine = RigSession(config).engine
    server = Server(config, engine)

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    app = FastAPI(title="rig_decode", lifespan=lifespan)
    app.state.rig = server
    app.add_middleware(_BodyLimit, limit=config.server.max_request_bytes, on_refused=lambda scope: server.metrics
                       .requests.labels(_route(scope["path"]), "413", "none").inc())

    def error(status: int, message: str, type_: str, code=None, param=None, headers=None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        server.metrics.requests.labels(_endpoint(request), str(e.status), _key(request)).inc()
        return error(e.status, e.message, e.type, e.code, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        server.metrics.requests.labels(_endpoint(request), "400", _key(request)).inc()
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            why = (errors[0].get("ctx") or {}).get("error", "JSON decode error")
            return error(400, f"the request body is not valid JSON: {why} (at character {errors[0]['loc'][-1]})",
                         "invalid_request_error", "invalid_json")
        problems = []
        for err in errors:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        param = ".".join(str(p) for p in errors[0].get("loc", ()) if p != "body") if errors else None
        return error(400, "invalid request: " + "; ".join(problems), "invalid_request_error", "invalid_request",
                     param or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail), "invalid_request_error")

    @app.get("/health")
    async def health():
        """``status`` is ok while the server serves; ``retrieval`` says whether searches run
        (``degraded``: too many hung searches, hops answer without evidence; ``retrieval_reason``)."""
        retrieval = server.engine.retrieval_health()
        return {"status": "ok", "model": server.model_id, "in_flight": server.front.num_active,
                "retrieval": retrieval["status"], "retrieval_reason": retrieval["reason"],
                "hung_searches": retrieval["hung_searches"], "abandoned_searches": retrieval["abandoned_searches"]}

    @app.get("/metrics")
    async def metrics():
        server.count_finished()
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        page = resources.files("rig_decode.server").joinpath("static/playground.html").read_text("utf-8")
        return page.replace("{{MODEL}}", html.escape(server.model_id))

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        server.check_auth(request)
        if model_id != server.model_id:
            raise ApiError(404, f"the model {model_id!r} does not exist", code="model_not_found")
        return _model_card(server)

    async def handle(req: GenerationRequest, request: Request, chat: bool):
        tenant = server.check_auth(request)
        handle = await server.submit(req, tenant)  # errors surface here, before the response starts
        seq = handle.seq
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": server.model_id}

        def choice(text: str, finish: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if req.stream:
            async def sse():
                try:
                    async for chunk in _sse_chunks():
                        yield chunk
                finally:  # closed early (client gone) before or while streaming: stop the request
                    if not seq.is_finished:
                        handle.cancel()

            async def _sse_chunks():
                obj = {**base, "object": kind + ".chunk" if chat else kind}
                if chat:
                    yield _sse({**obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None, "logprobs": None}]})
                async for up in server.updates(handle):
                    if up.hop is not None:  # an extension chunk: no choices, OpenAI clients skip it
                        yield _sse({**obj, "choices": [], "rig": {"hop": hop_json(up.hop)}})
                    elif up.finish is not None and seq.finish_reason == "error":  # OpenAI's in-stream error
                        yield _sse(error_body(_engine_error(seq), "server_error", "engine_error"))
                    elif up.finish is not None:
                        yield _sse({**obj, "choices": [choice(up.text, up.finish)], "rig": rig_json(seq.trace)})
                        if req.include_usage:
                            yield _sse({**obj, "choices": [], "usage": usage_json(seq.trace)})
                    elif up.text:
                        yield _sse({**obj, "choices": [choice(up.text, None)]})
                yield "data: [DONE]\n\n"

            server.metrics.requests.labels(_endpoint(request), "200", _key(request)).inc()
            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts, finish = [], "stop"
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        try:
            async for up in server.updates(handle):
                parts.append(up.text)
                finish = up.finish or finish
        finally:
            watcher.cancel()
        if seq.finish_reason == "error":
            raise ApiError(500, _engine_error(seq), "server_error", "engine_error")
        server.metrics.requests.labels(_endpoint(request), "200", _key(request)).inc()
        content = "".join(parts)
        if chat:
            out = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish,
                   "logprobs": None}
        else:
            out = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
        return {**base, "object": kind, "choices": [out], "usage": usage_json(seq.trace),
                "rig": rig_json(seq.trace)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await handle(req, request, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await handle(req, request, chat=False)

    return app


class _BodyLimit:
    """ASGI middleware: requests reach the app only with a body within ``limit`` (``limited_receive``)."""

    def __init__(self, app, limit: int, on_refused=None):
        self.app, self.limit, self.on_refused = app, limit, on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            receive = await limited_receive(scope, receive, send, self.limit, self.on_refused)
            if receive is None:  # refused with a 413, or the client went away
                return
        await self.app(scope, receive, send)


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    while not handle.seq.is_finished:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            handle.cancel()
            return


_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def _endpoint(request: Request) -> str:
    return _route(request.url.path)


def _route(path: str) -> str:
    """The metrics label of a request: its route, never the raw path (bounded label values)."""
    if path in _ENDPOINTS:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


def _key(request: Request) -> str:
    """The metrics label of a request's API key: its name (``none`` before or without a valid key)."""
    return getattr(request.state, "key", "none")


def _engine_error(seq) -> str:
    errors = seq.trace.engine_errors
    return f"engine error: {errors[-1]}" if errors else "engine error"


def _model_card(server: Server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "rig_decode"}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


