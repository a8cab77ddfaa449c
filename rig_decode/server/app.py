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
from ..prompt import build_prompt
from ..trace import RetrievalStep, Trace
from .metrics import Metrics
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, error_body

# The engine's finish reasons, in OpenAI's vocabulary (the exact one is in ``rig.finish_reason``).
_FINISH = {"stop": "stop", "length": "length", "context_full": "length", "deadline": "length",
           "cancelled": "stop", "error": "stop"}


@dataclass(slots=True)
class Update:
    """One piece of a request's progress: answer ``text``, a finished ``hop``, or the ``finish`` reason."""

    text: str = ""
    hop: RetrievalStep | None = None
    finish: str | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers


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
            "evidence_tokens": trace.evidence_tokens, "finish_reason": trace.finish_reason,
            "marker_errors": list(trace.marker_errors), "engine_errors": list(trace.engine_errors),
            "timings": timings, "gate": list(trace.gate),
            "citations": list(trace.citations)}


def usage_json(trace: Trace) -> dict:
    return {"prompt_tokens": trace.prompt_tokens, "completion_tokens": trace.generated_tokens,
            "total_tokens": trace.prompt_tokens + trace.generated_tokens}


class Server:
    """The state behind the routes: one engine, its async front, the metrics."""

    def __init__(self, config: RigConfig, engine: RigEngine):
        self.config, self.engine = config, engine
        self.metrics = Metrics(engine)
        self.front = AsyncRigEngine(engine)
        self.model_id = config.server.model_name or Path(config.model.name).name
        self.spec = MarkerSpec.from_style(config.rig.marker_style)
        self.system = config.system_prompt()
        self.created = int(time.time())
        self.memories: OrderedDict[str, EvidenceMemory] = OrderedDict()

    MAX_CONVERSATIONS = 1024

    def memory(self, conversation_id: str | None) -> EvidenceMemory | None:
        """The conversation's evidence memory (the least recently used ones are forgotten)."""
        if conversation_id is None:
            return None
        memory = self.memories.pop(conversation_id, None) or EvidenceMemory()
        self.memories[conversation_id] = memory
        while len(self.memories) > self.MAX_CONVERSATIONS:
            self.memories.popitem(last=False)
        return memory

    # -- requests -> sequences ---------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        key = self.config.server.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}":
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           "authentication_error", "invalid_api_key")

    def prompt_ids(self, req: GenerationRequest, memory: EvidenceMemory | None = None) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(req, ChatCompletionRequest):
            try:
                messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                            for m in req.messages]
                return build_prompt(tok, messages, self.spec, self.system,
                                    memory.prompt_text() if memory else "")
            except Exception as e:  # noqa: BLE001 - e.g. the chat template rejects the role order
                raise ApiError(400, f"cannot build the prompt from these messages: {e}", param="messages") from None
        if not req.prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        if req.rig.conversation_id is not None:
            raise ApiError(400, "rig.conversation_id needs /v1/chat/completions (a completion prompt has no place "
                                "for the conversation's evidence)", param="rig.conversation_id")
        return tok.encode(req.prompt, add_special_tokens=False)

    def count_finished(self) -> None:
        """Metrics for the requests the engine finished since the last call (done at every submit
        and scrape, so the engine's list of them stays short)."""
        for seq in self.front.take_finished():
            self.metrics.observe(seq.trace)

    def submit(self, req: GenerationRequest) -> RequestHandle:
        self.count_finished()
        if req.model != self.model_id:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {self.model_id!r}",
                           code="model_not_found", param="model")
        if self.front.num_active >= self.config.server.max_concurrency:
            raise ApiError(429, f"server busy: {self.front.num_active} requests in flight "
                                f"(server.max_concurrency = {self.config.server.max_concurrency}); retry later",
                           "rate_limit_error", "overloaded", headers={"Retry-After": "1"})
        memory = self.memory(req.rig.conversation_id)
        ids = self.prompt_ids(req, memory)
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
            return self.front.submit(ids, question=_question(req), max_new_tokens=max_new,
                                     max_iterations=hops, top_k=req.rig.top_k, temperature=req.temperature,
                                     top_p=req.top_p, seed=req.seed, memory=memory, stop=req.stop,
                                     raw=req.rig.show_evidence)
        except ValueError as e:  # prompt too long for the context or the KV budget
            raise ApiError(400, str(e), code="context_length_exceeded") from None

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


def _question(req: GenerationRequest) -> str:
    if isinstance(req, ChatCompletionRequest):
        users = [m for m in req.messages if m.role == "user"]
        return users[-1].text() if users else ""
    return req.prompt


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

    def error(status: int, message: str, type_: str, code=None, param=None, headers=None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        server.metrics.requests.labels(_endpoint(request), str(e.status)).inc()
        return error(e.status, e.message, e.type, e.code, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        server.metrics.requests.labels(_endpoint(request), "400").inc()
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
        server.check_auth(request)
        handle = server.submit(req)  # errors surface here, before the response starts
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

            server.metrics.requests.labels(_endpoint(request), "200").inc()
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
        server.metrics.requests.labels(_endpoint(request), "200").inc()
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


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    while not handle.seq.is_finished:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            handle.cancel()
            return


_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def _endpoint(request: Request) -> str:
    """The metrics label of a request: its route, never the raw path (bounded label values)."""
    path = request.url.path
    if path in _ENDPOINTS:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


def _engine_error(seq) -> str:
    errors = seq.trace.engine_errors
    return f"engine error: {errors[-1]}" if errors else "engine error"


def _model_card(server: Server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "rig_decode"}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


