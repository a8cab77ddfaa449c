"""An asyncio front for ``RigEngine``: submit requests from any coroutine, stream their tokens.

The engine's step loop runs on its own thread. After every step the loop turns what changed into
events and hands each to its request's asyncio queue:

    TokenEvent(token_ids, mask, text)  tokens appended since the last event (mask 0 = evidence/
                                  forced), and the answer text that became final with them
                                  (``Sequence.advance_answer``: markers hidden, a possible marker
                                  or stop-string start held back)
    HopEvent(step)                a retrieval finished and its evidence was queued for splicing
    FinishEvent(reason, trace, text)  the request is done (the rest of the answer); nothing follows

Events are built on the engine thread between steps, so what they carry is a consistent snapshot:
consumers never read a sequence's state while the engine changes it.

Cancelling a handle (or dropping the client) removes the sequence from the batch at the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from dataclasses import dataclass

from ..trace import RetrievalStep, Trace
from .engine import RigEngine
from .sequence import Sequence


@dataclass(slots=True)
class TokenEvent:
    token_ids: list[int]
    mask: list[int]
    text: str = ""


@dataclass(slots=True)
class HopEvent:
    step: RetrievalStep


@dataclass(slots=True)
class FinishEvent:
    reason: str
    trace: Trace
    text: str = ""


class RequestHandle:
    def __init__(self, engine: "AsyncRigEngine", seq: Sequence, loop: asyncio.AbstractEventLoop):
        self.seq, self._engine, self._loop = seq, engine, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._sent_tokens, self._sent_hops, self._sent_text, self._done = len(seq.prompt_ids), 0, 0, False

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    def cancel(self) -> None:
        self.seq.cancelled = True  # seen at the next step wherever the sequence is (queue, admission, batch)
        self._engine.wake()

    async def __aiter__(self):
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, FinishEvent):
                return

    async def result(self) -> Sequence:
        async for _ in self:
            pass
        return self.seq

    def _events(self) -> list:
        """What changed since the last call (runs on the engine thread, between steps)."""
        s, out = self.seq, []
        while self._sent_hops < len(s.trace.retrieval_steps):
            step = s.trace.retrieval_steps[self._sent_hops]
            end = step.position  # tokens up to the evidence go out before the hop event
            if end > self._sent_tokens:
                out.append(TokenEvent(s.token_ids[self._sent_tokens : end], s.mask[self._sent_tokens : end],
                                      self._new_text(s, end)))
                self._sent_tokens = end
            out.append(HopEvent(step))
            self._sent_hops += 1
        if len(s.token_ids) > self._sent_tokens:
            out.append(TokenEvent(s.token_ids[self._sent_tokens :], s.mask[self._sent_tokens :], self._new_text(s)))
            self._sent_tokens = len(s.token_ids)
        if s.is_finished and not self._done:
            out.append(FinishEvent(s.finish_reason or "", s.trace, self._new_text(s)))
            self._done = True
        return out

    def _new_text(self, s: Sequence, upto: int | None = None) -> str:
        """The answer text not sent yet, from the tokens up to ``upto`` (``finish`` made all of it
        final already)."""
        if not s.is_finished:
            s.advance_answer(upto=upto)
        text = s.answer_text
        new, self._sent_text = text[self._sent_text :], len(text)
        return new


class AsyncRigEngine:
    def __init__(self, engine: RigEngine):
        self.engine = engine
        self._finished: deque[Sequence] = deque()  # finished requests not taken yet (``take_finished``)
        self._handles: dict[int, RequestHandle] = {}
        self._ids = itertools.count(1)
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rig-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], question: str = "", **overrides) -> RequestHandle:
        """Queue a request (call from a coroutine: events go to the running event loop);
        ``overrides`` are ``RigEngine.new_sequence``'s per-request options."""
        loop = asyncio.get_running_loop()
        seq = self.engine.new_sequence(prompt_ids, seq_id=next(self._ids), question=question, **overrides)
        handle = RequestHandle(self, seq, loop)
        with self._lock:  # registered and queued together: a failing step sees both or neither
            self._handles[seq.seq_id] = handle
            self.engine.add(seq)
        self.wake()
        return handle

    def take_finished(self) -> list[Sequence]:
        """The requests that finished since the last call, each once, whether or not anyone still
        listened to them (a cancelled request's client is gone): what metrics count."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    @property
    def num_active(self) -> int:
        return len(self._handles)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001 - a broken step must not strand the clients
                self._fail_all(e)
                continue
            self._dispatch()

    def _dispatch(self) -> None:
        with self._lock:
            handles = list(self._handles.values())
        for h in handles:
            events = h._events()
            for ev in events:
                h._loop.call_soon_threadsafe(h.queue.put_nowait, ev)
            if h.seq.is_finished:
                with self._lock:
                    self._handles.pop(h.seq_id, None)
                self._finished.append(h.seq)

    def _fail_all(self, error: Exception) -> None:
        """A step failed for the whole batch: every request in it ends with reason ``error``, and
        the engine starts empty for the requests that come next."""
        with self._lock:  # no submit slips in between: a request is either failed here or kept
            handles, self._handles = list(self._handles.values()), {}
            self.engine.abort_all(error)
        for h in handles:
            for ev in h._events():
                h._loop.call_soon_threadsafe(h.queue.put_nowait, ev)
            self._finished.append(h.seq)

    def close(self) -> None:
        self._stop = True
        self.wake()
        self._thread.join(timeout=5)
        self.engine.close()
