"""A model runner over vLLM in this process (``AsyncLLM``, V1 engine): ``engine.backend: vllm``.

vLLM runs on its own asyncio loop, on a background thread; each engine step hands it every row that
needs the model at once, as concurrent requests, so vLLM schedules them as one batch. Like the
remote runner (which this one extends), the engine sees each position's top ``top_logprobs``
log-probabilities as sparse logits and does all masking and sampling itself; vLLM decodes greedily.
Two modes (``engine.vllm.mode``; ``auto`` takes ``stream`` where vLLM has ``StreamingInput``):

* ``stream``: one resumable request per row, kept open while the row lives. Every step sends the
  row's new token ids as one ``StreamingInput`` chunk and asks for exactly one token (``max_tokens=1``).
  vLLM keeps a session's KV between chunks and drops the last sampled token of a chunk (it has no
  KV yet), so the next chunk starts with the token the engine actually chose: rejecting vLLM's
  pick costs nothing, and a hop's chunk (marker token + evidence) is prefilled alone onto the KV the
  request kept. The row's session ends (its input generator returns) when the row leaves the batch.
* ``prefix``: a new request per call with the row's full token ids, ``max_tokens=lookahead``, and the
  remote runner's lookahead logic: steps that take vLLM's predicted token cost no call. vLLM's
  automatic prefix cache holds the earlier tokens (full blocks), so a hop's call prefills the
  evidence and the partial last block.

Each call's prompt accounting goes into the hop's trace (``row_info``): ``mode``, ``cache_n`` tokens
not evaluated, ``prompt_n`` tokens evaluated, and vLLM's ``num_cached_tokens`` as reported. In prefix
mode ``cache_n`` is that figure. In stream mode ``cache_n`` is the tokens the session kept plus, on
its first chunk, the prefix-cache hits vLLM reported: vLLM sets ``num_cached_tokens`` once, from a
request's first scheduled prefill, and every later output of the session repeats that figure.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .runner_remote import Completion, Prediction, RemoteError, RemoteRow, RemoteRunner
from .vllm_api import VllmApi, engine_args_kwargs, load_vllm_api, resolve_mode


SHUTDOWN_TIMEOUT_S = 30.0
"""How long vLLM's engine process may take to exit once told to: its default (5 s) is shorter than a
CPU worker's teardown, which then ends with a force-kill warning."""


async def _call(fn, **kwargs):
    return fn(**kwargs)


class VllmError(RemoteError):
    """vLLM refused a request or answered something this runner cannot use."""


class EventLoopThread:
    """An asyncio loop on a daemon thread; ``run`` waits for a coroutine from any other thread."""

    def __init__(self, name: str = "rig-vllm"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()  # the coroutine would otherwise run on with nobody waiting for it
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class _Session:
    """One row's resumable request: chunks go in through ``inbox``; ``outputs`` is vLLM's
    ``generate()`` stream for the whole session. Created and used on the loop thread only."""

    def __init__(self, engine, params, request_id: str):
        self.request_id = request_id
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outputs = engine.generate(self._inputs(), params, request_id)
        self.chunks = 0

    async def _inputs(self):
        while (chunk := await self.inbox.get()) is not None:
            yield chunk

    async def send(self, chunk) -> tuple[list[int], list, int | None]:
        """Queue a chunk; (token ids, logprobs, num_cached_tokens) of what vLLM decoded for it."""
        self.inbox.put_nowait(chunk)
        self.chunks += 1
        ids, logprobs, cached = [], [], None
        while True:
            try:
                out = await self.outputs.__anext__()
            except StopAsyncIteration:
                raise VllmError(f"vLLM ended the session {self.request_id} while a chunk was in flight") from None
            o = out.outputs[0]
            ids += o.token_ids
            logprobs += o.logprobs or []
            cached = getattr(out, "num_cached_tokens", cached)
            if o.finish_reason is not None or out.finished:
                return ids, logprobs, cached

    async def end(self, timeout_s: float = 30.0) -> None:
        """End the input; vLLM then finishes the session (its output stream ends)."""
        self.inbox.put_nowait(None)
        try:
            async def drain():
                async for _ in self.outputs:
                    pass

            await asyncio.wait_for(drain(), timeout_s)
        finally:
            await self.outputs.aclose()  # no-op once drained; aborts the request otherwise


@dataclass(slots=True)
class _SessionRow(RemoteRow):
    session: _Session | None = None
    held: int = 0
    """Leading tokens whose KV the session holds (everything it was sent)."""
    prompt_len: int = 0


_ids = itertools.count()


class VllmRunner(RemoteRunner):
    """The engine's runner interface over an ``AsyncLLM``-like ``engine`` (see the module docstring).

    ``api`` supplies the request types (``VllmApi``); ``loop`` the thread ``engine`` runs on (a new
    one by default, closed with the runner; one passed in is closed only with ``owns_loop``).
    ``marker_rules``: a ``vllm_logits.MarkerRules`` to send with every request, for the optional
    marker logits processor. ``owns_engine``: ``close`` shuts the engine down."""

    def __init__(self, engine, api: VllmApi, vocab_size: int, *, mode: str = "auto", top_logprobs: int = 20,
                 lookahead: int = 16, context_limit: int = 8192, marker_rules=None,
                 loop: EventLoopThread | None = None, owns_loop: bool | None = None, owns_engine: bool = False,
                 timeout_s: float | None = None):
        self.engine, self.api = engine, api
        self.mode = resolve_mode(mode, api)
        self.owns_loop = loop is None if owns_loop is None else owns_loop
        self.loop = loop or EventLoopThread()
        self.marker_rules, self.owns_engine, self.timeout_s = marker_rules, owns_engine, timeout_s
        self._ending: list[Future] = []
        self._closed = False
        super().__init__(_NoServer(), vocab_size, lookahead=1 if self.mode == "stream" else lookahead,
                         top_logprobs=top_logprobs, context_limit=context_limit)

    def _new_row(self) -> _SessionRow:
        return _SessionRow()

    def add_rows(self, prompts: list[list[int]], share_prefix: bool = True) -> list[list[int]]:
        feeds = super().add_rows(prompts, share_prefix)
        for row, p in zip(self.rows[len(self.rows) - len(prompts):], prompts):
            row.prompt_len = len(p)
        return feeds

    def select(self, keep: list[int]) -> None:
        kept = set(keep)
        self._end_sessions([r for i, r in enumerate(self.rows) if i not in kept])
        super().select(keep)

    def reset(self, batch_size: int = 0) -> None:
        self._end_sessions(self.rows)
        super().reset(batch_size)

    def _end_sessions(self, rows) -> None:
        for row in rows:
            if row.session is not None:
                self._ending.append(self.loop.submit(row.session.end()))
                row.session = None
        self._ending = [f for f in self._ending if not f.done()]

    def _ask(self, ask: list[int]) -> None:
        rows = [self.rows[i] for i in ask]
        one = self._stream_one if self.mode == "stream" else self._request_one

        async def all_rows():
            return await asyncio.gather(*(one(row) for row in rows))

        self._take(ask, self.loop.run(all_rows(), self.timeout_s))

    def _params(self, max_tokens: int, kind, row: _SessionRow, **extra):
        if self.marker_rules is not None:
            extra["extra_args"] = self.marker_rules.to_extra_args(count_from=row.prompt_len)
        return self.api.SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=self.top_logprobs,
                                       output_kind=kind, **extra)

    async def _stream_one(self, row: _SessionRow) -> tuple[Completion, dict]:
        # ignore_eos: a chunk always ends at its one token; whether the row stops is the engine's call
        params = self._params(1, self.api.RequestOutputKind.DELTA, row, ignore_eos=True)
        if row.session is None:
            row.session = _Session(self.engine, params, f"rig-{next(_ids)}")
        chunk = row.tokens[row.held:]
        first = row.session.chunks == 0
        ids, logprobs, cached = await row.session.send(
            self.api.StreamingInput(prompt=self.api.TokensPrompt(prompt_token_ids=chunk), sampling_params=params))
        if not ids:
            raise VllmError(f"vLLM returned no token for a chunk of {row.session.request_id} "
                            f"({len(row.tokens)} tokens; max_model_len too small?)")
        reused = (cached or 0) if first else row.held
        completion = Completion(self._predictions(ids[:1], logprobs[:1]), reused, len(row.tokens) - reused)
        info = self._accept(row.tokens, completion)
        info.update(mode="stream", num_cached_tokens=cached)
        row.held = len(row.tokens)
        return completion, info

    async def _request_one(self, row: _SessionRow) -> tuple[Completion, dict]:
        tokens = list(row.tokens)
        params = self._params(self._predict_n(tokens), self.api.RequestOutputKind.FINAL_ONLY, row)
        final = None
        async for out in self.engine.generate(self.api.TokensPrompt(prompt_token_ids=tokens), params,
                                              f"rig-{next(_ids)}"):
            final = out
        if final is None:
            raise VllmError("vLLM returned no output for a request")
        o = final.outputs[0]
        cached = getattr(final, "num_cached_tokens", None)
        completion = Completion(self._predictions(list(o.token_ids), list(o.logprobs or [])), cached,
                                None if cached is None else len(tokens) - cached,
                                getattr(final, "prompt_token_ids", None))
        info = self._accept(tokens, completion)
        info.update(mode="prefix", num_cached_tokens=cached)
        return completion, info

    def _predictions(self, ids: list[int], logprobs: list) -> list[Prediction]:
        """vLLM's ``logprobs``: per position, a mapping token id -> ``Logprob`` (or a float); the top
        ``logprobs`` plus the sampled token. A ``FlatLogprobs`` (``flat_logprobs=True``) iterates the same."""
        if len(logprobs) < len(ids):
            raise VllmError("vLLM returned tokens without logprobs: is SamplingParams.logprobs honoured?")
        preds = []
        for tok, position in zip(ids, logprobs):
            pairs = [(int(t), float(getattr(lp, "logprob", lp))) for t, lp in (position or {}).items()]
            pairs.sort(key=lambda kv: -kv[1])
            preds.append(Prediction(int(tok), pairs[: self.top_logprobs] or [(int(tok), 0.0)]))
        return preds

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_sessions(self.rows)
        for f in self._ending:
            try:
                f.result(timeout=30)
            except Exception:  # noqa: BLE001 - a session that fails to end must not block shutdown
                pass
        self._ending = []
        if self.owns_engine and hasattr(self.engine, "shutdown"):
            engine, self.engine = self.engine, None
            self.loop.run(_call(engine.shutdown, timeout=SHUTDOWN_TIMEOUT_S), timeout=SHUTDOWN_TIMEOUT_S + 30)
            # AsyncLLM.__del__ shuts down once more: let that happen now, not at interpreter exit,
            # where vLLM's module globals are already gone (a TypeError printed on the way out)
            del engine
            gc.collect()
        if self.owns_loop:
            self.loop.close()
        super().close()


class _NoServer:
    """The remote runner's server slot: vLLM is asked through ``VllmRunner._ask`` instead."""

    def context_limit(self) -> None:
        return None

    def close(self) -> None:
        pass


def vllm_runner(cfg, tokenizer_len: int, *, tokenizer=None, api: VllmApi | None = None, engine=None,
                stop_ids=()) -> VllmRunner:
    """The runner for a ``RigConfig`` with ``engine.backend: vllm``: builds ``AsyncEngineArgs`` from
    ``model`` and ``engine.vllm`` and starts an ``AsyncLLM`` on the runner's loop thread. ``api`` and
    ``engine`` replace vLLM's (tests); ``tokenizer`` and ``stop_ids`` give the marker logits
    processor its token ids (``engine.vllm.logits_processor``)."""
    v = cfg.engine.vllm
    api = api or load_vllm_api()
    mode = resolve_mode(v.mode, api)
    rules = None
    if v.logits_processor:
        from .vllm_logits import MarkerRules

        if tokenizer is None:
            raise ValueError("engine.vllm.logits_processor needs the tokenizer (the markers' token ids)")
        eos = tokenizer.eos_token_id
        rules = MarkerRules.from_tokenizer(tokenizer, [*stop_ids, *([eos] if eos is not None else [])],
                                           cfg.rig.max_iterations, cfg.rig.max_query_tokens)
        # the processor implements the V1 model runner's interface; the V2 runner rejects it
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    owns = engine is None
    # built before the loop thread starts: a config this vLLM cannot serve leaves no thread behind
    args = api.AsyncEngineArgs(**engine_args_kwargs(cfg, api)) if owns else None
    loop = EventLoopThread()
    if owns:

        async def start():  # on the loop thread: AsyncLLM binds its output handler to the running loop
            return api.AsyncLLM.from_engine_args(args)

        try:
            engine = loop.run(start())
        except BaseException:
            loop.close()
            raise
    return VllmRunner(engine, api, tokenizer_len, mode=mode, top_logprobs=v.top_logprobs, lookahead=v.lookahead,
                      context_limit=v.max_model_len, marker_rules=rules, loop=loop, owns_loop=True,
                      owns_engine=owns)
