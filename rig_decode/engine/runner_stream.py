"""The remote runner that streams: one server request per stretch between hops, not per token.

``RemoteRunner`` (``runner_remote.py``) asks a completion server for ``lookahead`` tokens at a time
and waits for all of them before the engine sees the first. This runner asks for the rest of the
row (up to the end of the context) with ``stream: true`` and hands each
prediction to the engine as it arrives: the server decodes at its own pace, the engine's logits
processors run on each position's top log-probabilities as before (so greedy decoding picks the
tokens the in-process engine would), and a row costs a new request only where the engine takes a
token the server did not predict:

* a hop: when the row parks for its search, the engine closes its stream (``pause``: the server
  stops decoding on the closed connection instead of running on while the search runs); the
  evidence then goes up as the next request's new tokens, the server's prompt cache holding
  everything before them, and the first token after the evidence streams back as soon as the
  server has it;
* a token a logits processor forced or banned (the query cap, the hop budget, the newline rule,
  citations): the stream is closed and a new one starts from the engine's token.

Where the rules at a row's next position only ban tokens (outside a query: the hop budget, a stray
end delimiter, citations outside a number) and the row decodes greedily, the engine passes the bans
(``Sampler.fixed_bans``) and the stream asks the server to apply them (``logit_bias``) and send no
log-probabilities: the server's own greedy pick is then the engine's, which takes it as it is
(``take_picks``: its processors do not run again on what they would only ban), and the server skips
the top-N list it would otherwise build per token. Such a stream stops after a token
that opens a query (``opens_query``), where the newline rule needs the scores again: a hop costs two
requests then (the query, the answer after the evidence), each of them cheap next to the tokens it
spares the sort. A row whose bans change (or that needs scores) gets a new stream.

On llama-server each row keeps one slot (``id_slot``) for its whole life, so a new request finds
its prefix in the slot's cache even while the closed stream's slot is still finishing its last
token (llama-server defers a request for a busy slot); the engine's batch is held to the server's
slots (``max_rows``), since a stream holds its slot while it lives. A stream ends with its row
(``select``), and runs at most ``RUN_AHEAD`` tokens ahead of the engine.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from functools import partial

import torch

from .runner_remote import RemoteRunner
from .servers import Prediction, RemoteError, make_server

END = object()
"""What a stream's queue holds after its last prediction."""

STREAM_TOKENS = 1024
"""The most tokens one request asks for (bounded by the context too)."""

RUN_AHEAD = 16
"""Predictions a stream may hold that the engine has not taken yet. The server decodes as fast as it
can, whatever the engine's pace (at a high concurrency on shared cores, faster): past this, the
stream closes itself, and the engine opens a new one (its prompt cached) when it has caught up. So
a forced token wastes at most this many decoded tokens, not everything up to the end (a hop wastes
next to none: the stream closes at the end delimiter, ``stop_after``)."""


class _Stream:
    """One streamed completion: a thread reads the server's predictions into a queue."""

    def __init__(self, request, stop_after: frozenset[int] = frozenset()):
        """``request(cancelled=, opened=)``: the server's ``stream_completion`` with its arguments."""
        self.predictions: queue.Queue = queue.Queue()
        self.info: dict | None = None
        """The server's accounting of the prompt (tokens from its cache, tokens evaluated)."""
        self.closed = False
        self.response = None
        self.thread = threading.Thread(target=self._read, name="rig-remote-stream", daemon=True,
                                       args=(request, stop_after))
        self.thread.start()

    def _read(self, request, stop_after) -> None:
        try:
            for preds, info in request(cancelled=lambda: self.closed, opened=self._opened):
                if info is not None and self.info is None:
                    self.info = info
                for p in preds:
                    self.predictions.put(p)
                    if p.token in stop_after:  # an end delimiter: the row parks for its search next
                        self.closed = True
                if self.closed or self.predictions.qsize() >= RUN_AHEAD:  # (or far enough ahead of the engine)
                    self.closed = True
                    break
        except BaseException as e:  # noqa: BLE001 - the engine's thread raises it for this row
            self.predictions.put(e)
        self.predictions.put(END)

    def _opened(self, response) -> None:
        self.response = response
        if self.closed:  # closed before the server answered
            self.close()

    def next(self, timeout: float) -> Prediction | None:
        """The next prediction (None: the stream ended)."""
        try:
            item = self.predictions.get(timeout=timeout)
        except queue.Empty:
            raise RemoteError(f"the server sent no token for {timeout:g}s") from None
        if item is END:
            self.predictions.put(END)  # stays ended
            return None
        if isinstance(item, BaseException):
            raise item if isinstance(item, RemoteError) else RemoteError(f"{type(item).__name__}: {item}")
        return item

    def close(self) -> None:
        """Stop reading and close the connection now (the reader wakes with an error it ignores)."""
        self.closed = True
        response = self.response
        if response is not None:
            try:
                response.close()
            except Exception:  # noqa: BLE001 - closed under a reader, or twice: it is closed either way
                pass


@dataclass(slots=True)
class StreamRow:
    tokens: list[int]
    slot: int | None = None
    stream: _Stream | None = None
    next: Prediction | None = None
    """The server's prediction for the position after ``tokens``."""
    info: dict | None = None
    bans: frozenset[int] | None = None
    """The rules the row's stream runs under, as bans the server applies (it sends no scores); None:
    the stream sends each position's top log-probabilities and the engine applies the rules."""


class StreamingRunner(RemoteRunner):
    """The engine's runner interface over a streaming completion server (see the module docstring)."""

    pushes_bans = True
    """``step`` takes each row's bans (``Sampler.fixed_bans``) for the server to apply."""

    def __init__(self, server, vocab_size: int, *, top_logprobs: int = 20, context_limit: int | None = None,
                 timeout_s: float = 120.0):
        super().__init__(server, vocab_size, lookahead=STREAM_TOKENS, top_logprobs=top_logprobs,
                         context_limit=context_limit)
        self.timeout_s = timeout_s
        self.row_errors: dict[int, str] = {}
        """Rows whose server request failed in the last step (their logits are zeros): the engine
        ends each alone (``take_row_errors``)."""
        slots = server.total_slots()
        self.free_slots = list(range(slots)) if slots else []
        self.max_rows = slots
        """Rows that may decode at once (a server's slots; None: no limit)."""
        self.picks: dict[int, int] = {}
        """Rows whose token in the last step the server picked under the row's bans (``take_picks``)."""
        self.stop_after: frozenset[int] = frozenset()
        """Tokens after which a stream closes itself (the engine sets its end delimiter's, where it
        is one token): the server stops then, not when the engine gets there."""
        self.stop_text: tuple[str, ...] = ()
        """Text at which the server itself stops (its ``stop`` strings; the engine sets the text of
        an added token that spells a whole end delimiter, which no other token writes; an ordinary
        token's text, json's ``"}``, also ends inside other tokens): it decodes nothing past a hop's
        marker, where a closed connection stops it only once it fails to send the tokens after."""
        self.opens_query: frozenset[int] = frozenset()
        """Tokens that open a query by themselves: a stream that sends no scores stops after one (the
        rules inside a query need them), the server itself where an added token spells the start
        delimiter (``opens_query_text``)."""
        self.opens_query_text: tuple[str, ...] = ()

    def stop_at(self, vocab, stop_ids: list[int]) -> None:
        """Set where streams stop from the engine's markers (a ``MarkerVocab``) and stop ids."""
        added = set(getattr(vocab.tokenizer, "added_tokens_decoder", None) or ())  # text no other token writes

        def text(ids) -> tuple[str, ...]:
            return tuple(sorted({vocab.token_bytes[t].decode("utf-8", "replace") for t in ids if t in added}))

        ends = vocab.whole_end_ids.tolist()
        self.stop_after, self.stop_text = frozenset(ends) | frozenset(stop_ids), text(ends)
        self.opens_query = frozenset(vocab.start_completing_ids((0,) * len(vocab.start)).tolist())
        self.opens_query_text = text(self.opens_query)

    def reset(self, batch_size: int = 0) -> None:
        self._release(self.rows)
        self.rows = [self._new_row() for _ in range(batch_size)]

    def _new_row(self) -> StreamRow:
        return StreamRow([], self.free_slots.pop(0) if self.free_slots else None)

    def select(self, keep: list[int]) -> None:
        kept = set(keep)
        self._release([r for i, r in enumerate(self.rows) if i not in kept])
        self.rows = [self.rows[i] for i in keep]

    def _release(self, rows: list[StreamRow]) -> None:
        for row in rows:
            if row.stream is not None:
                row.stream.close()
            if row.slot is not None:
                self.free_slots.append(row.slot)
        self.free_slots.sort()

    def step(self, feeds: list[list[int]], bans: list[frozenset[int] | None] | None = None) -> torch.Tensor:
        """Append each row's tokens; log-probability rows for what comes next (zeros for rows that
        fed nothing). ``bans``: each row's rules at its next position as bans, where that is all
        they are (None: the engine needs the scores). A row whose stream predicted its token under
        the same rules reads the next prediction; the others start a new stream (all before any is
        waited for)."""
        assert len(feeds) == len(self.rows), "rows must match the batch"
        if not any(feeds):
            raise ValueError("no row has anything to feed")
        fed = [i for i, feed in enumerate(feeds) if feed]
        for i in fed:
            row, feed, want = self.rows[i], feeds[i], bans[i] if bans is not None else None
            follows = (row.stream is not None and row.next is not None and feed == [row.next.token]
                       and row.bans == want)
            row.tokens += feed
            if not follows:
                row.bans = want
                self._open(row)
        logits, self.picks = self._new_logits(feeds), {}
        for i in fed:
            row = self.rows[i]
            try:
                row.next = self._next(row)
                if row.bans and row.next.token in row.bans:  # a ban the server did not hold to (a bias
                    row.bans = None                          # too weak): this position from the scores
                    self._open(row)
                    row.next = self._next(row)
                self._write_scores(logits[i], row.next.top)
                if row.bans is not None:
                    self.picks[i] = row.next.token
            except RemoteError as e:  # this row's request failed: the others go on
                self.row_errors[i] = str(e)
                logits[i].numpy().fill(0.0)
                row.stream.close()
                row.stream = row.next = None
        return logits

    def pause(self, rows: list[int]) -> None:
        """These rows wait (for their search): their streams close, the next step opens new ones."""
        for i in rows:
            row = self.rows[i]
            if row.stream is not None:
                row.stream.close()
                row.stream = None

    def take_picks(self) -> dict[int, int]:
        """The last step's tokens the server picked under each row's bans, by row: the engine's
        processors would ban the same and its greedy pick is the server's, so it takes them as they
        are (``Sampler.sample``'s ``picked``)."""
        picks, self.picks = self.picks, {}
        return picks

    def take_row_errors(self) -> dict[int, str]:
        errors, self.row_errors = self.row_errors, {}
        return errors

    def _open(self, row: StreamRow) -> None:
        if row.stream is not None:
            row.stream.close()
        unscored = row.bans is not None
        request = partial(self.server.stream_completion, list(row.tokens), self._predict_n(row.tokens),
                          0 if unscored else self.top_logprobs, row.slot, banned=sorted(row.bans or ()),
                          stop=self.stop_text + self.opens_query_text if unscored else self.stop_text)
        row.stream = _Stream(request, self.stop_after | self.opens_query if unscored else self.stop_after)
        row.next = None
        self.calls += 1

    def _next(self, row: StreamRow) -> Prediction:
        """The row's next prediction; a stream that ended (its ``max_tokens`` spent, or closed after
        a stop token the engine did not take) is followed by a new one."""
        for attempt in range(2):
            fresh = row.next is None
            prediction = row.stream.next(self.timeout_s)
            if prediction is not None:
                if fresh and row.stream.info is not None:
                    row.info = dict(row.stream.info)
                return prediction
            if attempt == 0:
                self._open(row)
        raise RemoteError("the server ended a stream without a token (context full on the server side?)")

    def close(self) -> None:
        self._release(self.rows)
        self.rows = []
        super().close()


def remote_runner(cfg, vocab_size: int) -> RemoteRunner:
    """The runner for an ``engine.remote`` config section: streaming (``stream: true``, the
    default), or the lookahead runner."""
    server = make_server(cfg.api, cfg.base_url, model=cfg.model, api_key=cfg.api_key, timeout_s=cfg.timeout_s)
    if cfg.stream:
        return StreamingRunner(server, vocab_size, top_logprobs=cfg.top_logprobs, timeout_s=cfg.timeout_s)
    return RemoteRunner(server, vocab_size, lookahead=cfg.lookahead, top_logprobs=cfg.top_logprobs,
                        parallel=cfg.parallel)
