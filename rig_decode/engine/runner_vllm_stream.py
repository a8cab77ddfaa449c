"""vLLM's ``stream`` mode: one resumable request per row, decoding freely between hops.

Each row holds one vLLM session: a request whose prompt is an async generator of ``StreamingInput``
chunks, whose KV vLLM keeps between chunks. A chunk asks for the rest of the row (``STREAM_TOKENS``,
bounded by the context) and stops at the end delimiter, EOS and the engine's stop ids
(``stop_token_ids``): vLLM runs its own decode loop (batching, async scheduling, CUDA graphs), and
each token reaches the engine as vLLM emits it (DELTA outputs with the position's top
log-probabilities), where the engine's logits processors check it exactly as in the other backends
(where the rules at a position only ban tokens and vLLM's token is not one of them, the engine takes
it as it is: ``take_picks``).
The ``StreamingRunner`` logic does the rest (``runner_stream.py``); a row takes a new chunk only
where the engine does not take what vLLM sampled:

* a hop: the chunk stopped at the end delimiter; the next chunk is the delimiter and the evidence,
  prefilled onto the KV the session kept (vLLM drops a chunk's last sampled token, which has no KV),
  so the hop evaluates exactly the evidence and one token, and costs one call;
* a chunk that ended where the engine goes on (a stop id the engine banned, its ``max_tokens``): the
  next chunk is the engine's token, on the same session;
* a token the engine forced or banned while the chunk still runs (the hop budget, the query cap, the
  newline rule, citations): the session is aborted and a new one starts from the row's tokens, whose
  full KV blocks vLLM's prefix cache still holds. With ``engine.vllm.logits_processor`` vLLM samples
  under the marker rules itself (``vllm_logits.py``), and only the rules it does not know cost this.

A row that leaves the batch, or parks for a search while its chunk still runs, aborts its session.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from .inbox import END, Inbox
from .runner_stream import StreamingRunner, StreamRow
from .vllm_host import IDS_ONLY, NoServer, VllmError, VllmHost, predictions, rule_args

_ids = itertools.count()

TOKEN_TIMEOUT_S = 600.0
"""How long the engine waits for vLLM's next token of a row before failing that row: far past any
prefill or preemption, short of never (a request vLLM lost must not hold the engine's step)."""


class _Chunk(Inbox):
    """One chunk's outputs, as the engine reads them (``inbox.ServerStream``'s interface). The loop
    thread writes (``take``, ``fail``); the engine thread reads."""

    who = "vLLM"
    error = VllmError

    def __init__(self, start: int, sent: int, fresh: bool, top_logprobs: int, notify=None):
        super().__init__(notify)
        self.start, self.sent, self.fresh, self.top_logprobs = start, sent, fresh, top_logprobs
        self.tokens: list[int] = []
        """What vLLM sampled in this chunk, in order."""
        self.finished = False
        self.info: dict | None = None

    def take(self, out) -> None:
        o = out.outputs[0]
        if self.info is None:
            cached = getattr(out, "num_cached_tokens", None)
            # a fresh session's first lookup is vLLM's prefix cache; a later chunk's, the KV the session kept
            reused = (cached or 0) if self.fresh else self.start
            self.info = {"mode": "stream", "cache_n": reused, "prompt_n": self.start + self.sent - reused,
                         "num_cached_tokens": cached}
        preds = predictions(list(o.token_ids), list(o.logprobs or []), self.top_logprobs)
        self.tokens += [p.token for p in preds]
        done = o.finish_reason is not None or out.finished
        if o.finish_reason in ("error", "abort"):  # vLLM ended the request: not a chunk the session goes on from
            raise VllmError(f"vLLM finished the request with reason {o.finish_reason!r}")
        if done:  # after ``tokens``, before the predictions: once the engine reads the last one it may ask
            self.finished = True  # for the next chunk, and ``_kept`` must see the chunk whole and ended
        for p in preds:
            self.put(p)
        if done:
            self.put(END)

    def fail(self, error: BaseException) -> None:
        self.put(error if isinstance(error, VllmError) else VllmError(f"{type(error).__name__}: {error}"))
        self.put(END)

    def close(self) -> None:
        pass  # a chunk stops with its session (``_Session.abort``) or at its own stop


class _Session:
    """One row's resumable request. Built on the engine thread; everything else runs on the loop thread."""

    def __init__(self):
        self.request_id = f"rig-{next(_ids)}"
        self.inbox: asyncio.Queue | None = None
        self.chunk: _Chunk | None = None
        self.reader: asyncio.Task | None = None
        self.ended = False
        """vLLM ended the request (an error, its engine gone): no chunk can follow."""

    def send(self, engine, chunk: _Chunk, streaming_input) -> None:
        self.chunk = chunk
        if self.ended:  # ended while the row was not decoding (its search): the row fails now, not never
            chunk.fail(VllmError(f"vLLM ended the session {self.request_id}"))
            return
        if self.reader is None:
            self.inbox = asyncio.Queue()
            outputs = engine.generate(self._inputs(), streaming_input.sampling_params, self.request_id)
            self.reader = asyncio.ensure_future(self._read(outputs))
        self.inbox.put_nowait(streaming_input)

    async def _inputs(self):
        while (chunk := await self.inbox.get()) is not None:
            yield chunk

    async def _read(self, outputs) -> None:
        try:
            async for out in outputs:
                self.chunk.take(out)
        except asyncio.CancelledError:  # aborted: vLLM's generate() aborts the request on its way out
            raise
        except BaseException as e:  # noqa: BLE001 - the engine thread raises it for this row alone
            self.ended = True
            self.chunk.fail(e)
            await outputs.aclose()  # a request still running (a malformed output) is aborted now
            return
        self.ended = True
        self.chunk.fail(VllmError(f"vLLM ended the session {self.request_id}"))

    def abort(self) -> None:
        if self.reader is not None:
            self.reader.cancel()


@dataclass(slots=True)
class _SessionRow(StreamRow):
    session: _Session | None = None
    prompt_len: int = 0
    """Where the request's own tokens start (the marker rules count from there)."""


class VllmStreamRunner(StreamingRunner):
    """The engine's runner interface over vLLM sessions (see the module docstring). A chunk stops at
    ``stop_after``, which the engine sets: its end delimiter and its stop ids."""

    mode = "stream"
    pushes_bans = False  # every chunk sends scores (vLLM applies the rules only through marker_rules)

    def __init__(self, host: VllmHost, vocab_size: int, *, top_logprobs: int = 20, context_limit: int = 8192,
                 marker_rules=None, timeout_s: float | None = None):
        """``timeout_s``: how long to wait for a row's next token (None: ``TOKEN_TIMEOUT_S``)."""
        self.host, self.marker_rules = host, marker_rules
        self._aborted: list[_Session] = []
        self._closed = False
        super().__init__(NoServer(), vocab_size, top_logprobs=top_logprobs, context_limit=context_limit,
                         timeout_s=TOKEN_TIMEOUT_S if timeout_s is None else timeout_s)

    @property
    def engine(self):
        return self.host.engine

    def _new_row(self) -> _SessionRow:
        return _SessionRow([])

    def add_rows(self, prompts: list[list[int]], share_prefix: bool = True) -> list[list[int]]:
        self.rows += [_SessionRow([], prompt_len=len(p)) for p in prompts]
        return [list(p) for p in prompts]

    def _open(self, row: _SessionRow) -> None:
        self._open_all([row])

    def _open_all(self, rows: list[_SessionRow]) -> None:
        """Each row's next chunk, handed to the loop thread in one call: vLLM gets a step's new
        requests together (in the same engine step), not as the loop thread happens to wake."""
        sends = []
        for row in rows:
            held = self._kept(row)
            if held is None:  # nothing to continue from: a new session (the prefix cache holds full blocks)
                self._abort(row)
                row.session, held = _Session(), 0
            chunk = _Chunk(held, len(row.tokens) - held, held == 0, self.top_logprobs, self.arrived.set)
            sends.append((row.session, chunk, self._input(row, row.tokens[held:])))
            row.stream = chunk
            self._opened(row)
        if sends:
            self.host.loop.loop.call_soon_threadsafe(self._send_all, sends)

    def _send_all(self, sends) -> None:
        for session, chunk, streaming_input in sends:
            try:
                session.send(self.engine, chunk, streaming_input)
            except Exception as e:  # noqa: BLE001 - that row fails alone; the others are sent
                chunk.fail(e)

    def _kept(self, row: _SessionRow) -> int | None:
        """Leading tokens of the row whose KV its session holds and may go on from, or None: its last
        chunk ended (vLLM keeps that chunk's tokens but its last) and the engine took those tokens."""
        chunk = row.stream
        if row.session is None or row.session.ended or chunk is None or not chunk.finished or not chunk.tokens:
            return None
        held = chunk.start + chunk.sent + len(chunk.tokens) - 1
        if len(row.tokens) <= held or row.tokens[chunk.start + chunk.sent:held] != chunk.tokens[:-1]:
            return None
        return held

    def _input(self, row: _SessionRow, tokens: list[int]):
        api = self.host.api
        params = api.SamplingParams(max_tokens=self._predict_n(row.tokens), temperature=0.0,
                                    logprobs=self.top_logprobs, output_kind=api.RequestOutputKind.DELTA,
                                    stop_token_ids=sorted(self.stop_after), **IDS_ONLY,
                                    **rule_args(self.marker_rules, row.prompt_len))
        return api.StreamingInput(prompt=api.TokensPrompt(prompt_token_ids=list(tokens)), sampling_params=params)

    def _abort(self, row: _SessionRow) -> None:
        if row.session is not None:
            self.host.loop.loop.call_soon_threadsafe(row.session.abort)
            self._aborted = [s for s in self._aborted if s.reader is None or not s.reader.done()] + [row.session]
            row.session = None
        row.stream = row.next = None

    def pause(self, rows: list[int]) -> None:
        """A row that parks for its search while its chunk still decodes stops it (a chunk that ended
        at the end delimiter keeps its session)."""
        for i in rows:
            row = self.rows[i]
            if row.stream is not None and not row.stream.finished:
                self._abort(row)

    def _release(self, rows: list[_SessionRow]) -> None:
        for row in rows:
            self._abort(row)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def settled(sessions):  # each aborted request's clean-up (vLLM's abort) runs before the loop closes
            await asyncio.gather(*(s.reader for s in sessions if s.reader is not None), return_exceptions=True)

        try:
            self._release(self.rows)
            self.rows = []
            sessions, self._aborted = self._aborted, []
            self.host.loop.run(settled(sessions), timeout=30)
        finally:
            self.host.close()
