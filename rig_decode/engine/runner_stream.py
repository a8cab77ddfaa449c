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
(``Sampler.pick_rule``): a server's greedy token that none of them bans is the engine's pick, which
it takes as it is (``take_picks``: no scores written, no processors run, no argmax over the
vocabulary; most of the engine's work per token), whether the stream sent scores or not. Inside a
query the newline rule pools the probability of every token with a line break into the end
delimiter: on a stream with scores, a greedy token outside that pool, clearly more probable than
all of it, is the pick too (``PickRule.outweighs``), so most query tokens skip the processors. A new
stream under bans asks the server to apply them itself (``logit_bias``, ``pushes_bans``) and send
no log-probabilities, so the server skips the top-N list it would otherwise build per token; it
stops after a token that opens a query (``opens_query``), where the newline rule needs the scores
again, so the query costs a request of its own. Where queries open within a few tokens of their
stretch's start (a marker-trained model searches first, then answers), a stream that may open one
asks for scores from its start instead (``SCORED_LEAD``, ``_rules``) and runs on into the query:
one request per hop. A row whose bans change gets a new stream (a stream with scores serves any
rules).

On llama-server each row keeps one slot (``id_slot``) for its whole life, so a new request finds
its prefix in the slot's cache even while the closed stream's slot is still finishing its last
token (llama-server defers a request for a busy slot); the engine's batch is held to the server's
slots (``max_rows``), since a stream holds its slot while it lives. A stream ends with its row
(``select``), and runs at most ``inbox.RUN_AHEAD`` tokens ahead of the engine. The engine's steps
are partial (``step(partial=True)``): a row whose token is still on its way holds up no other row.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import partial

import torch

from .inbox import PENDING, ServerStream
from .runner_remote import BELOW_TOP, RemoteRunner
from .sampling import PickRule
from .servers import Prediction, RemoteError, make_server

STREAM_TOKENS = 1024
"""The most tokens one request asks for (bounded by the context too)."""

SCORED_LEAD = 8
"""A stream asks for scores from its start where the last query opened within this many tokens of
its stretch's start: a request at the query's start costs about what the scores of this many tokens
cost (on llama-server on 2 cores: 3-4.5 ms against 0.3-0.6 ms a token)."""


@dataclass(slots=True)
class StreamRow:
    tokens: list[int]
    slot: int | None = None
    stream: ServerStream | None = None
    next: Prediction | None = None
    """The server's prediction for the position after ``tokens``."""
    info: dict | None = None
    bans: frozenset[int] | None = None
    """The rules the row's stream runs under, as bans the server applies (it sends no scores); None:
    the stream sends each position's top log-probabilities and the engine applies the rules."""
    awaiting: list[int] | None = None
    """The feed whose prediction the engine has not had yet (a partial step left the row waiting)."""
    asked_at: float = 0.0
    """When the engine began waiting for the row's prediction (due within the timeout)."""
    ended: int = 0
    """Streams of the row that ended without a prediction since its last one."""
    stretch_at: int = 0
    """Where the row's current stretch began (after its prompt or its last evidence)."""
    want: PickRule | None = None
    """The rules at the position the row waits for a prediction of, as far as the server's greedy token
    and its scores decide the pick (None: the processors run on the scores)."""


class StreamingRunner(RemoteRunner):
    """The engine's runner interface over a streaming completion server (see the module docstring)."""

    takes_rules = True
    """``step`` takes each row's rules at its next position (``Sampler.pick_rule``; None: the
    processors need the scores there): a prediction they allow is the engine's pick (``take_picks``)."""
    pushes_bans = True
    """A new stream under bans asks the server to apply them and send no scores (``_rules``)."""
    partial_steps = True
    """``step(partial=True)`` answers the rows whose tokens have come, without waiting for the rest."""

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
        self.scored_lead = SCORED_LEAD
        self.lead = SCORED_LEAD + 1
        """Tokens the last query opened after its row's stretch began (``_rules``)."""
        self.answered: list[int] = []
        self.arrived = threading.Event()
        """Set whenever a stream has something for the engine (a partial step waits on it)."""
        self._woken = False

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

    def step(self, feeds: list[list[int]], rules: list[PickRule | None] | None = None, *,
             partial: bool = False, max_wait_s: float | None = None) -> torch.Tensor:
        """Append each row's tokens; log-probability rows for what comes next (zeros for rows that
        fed nothing). ``rules``: each row's rules at its next position (``Sampler.pick_rule``; None:
        the engine needs the scores). A row whose stream predicted its token under the same bans
        reads the next prediction; the others start a new stream (all before any is waited for).

        ``partial``: answer the rows whose predictions have come, as soon as one has (waiting at
        most ``max_wait_s``, or until ``wake``); ``take_answered`` says which. A row that is still
        waiting (its evidence being prefilled, say) does not hold up the others: the engine feeds
        it the same tokens again at its next step, which asks for the prediction again."""
        assert len(feeds) == len(self.rows), "rows must match the batch"
        opening = []
        for i, feed in enumerate(feeds):
            row = self.rows[i]
            if not feed:
                continue
            if row.awaiting is not None:  # fed again while its prediction is on the way
                if feed != row.awaiting:
                    raise ValueError(f"row {i} was fed {feed} while its feed {row.awaiting} waits for its prediction")
                continue
            want = rules[i] if rules is not None else None
            self._track(row, feed)
            follows = (row.stream is not None and row.next is not None and feed == [row.next.token]
                       and (row.bans is None or (want is not None and not want.pooled and row.bans == want.bans)))
            row.tokens += feed
            row.want = want
            if not follows:
                row.bans = self._rules(want)
                opening.append(row)
            row.awaiting, row.asked_at = list(feed), time.perf_counter()
        self._open_all(opening)
        waiting = [i for i, row in enumerate(self.rows) if row.awaiting is not None]
        if not waiting:
            raise ValueError("no row has anything to feed")
        logits, self.picks = self._new_logits([row.awaiting or [] for row in self.rows]), {}
        if partial:
            self.answered = self._gather(waiting, logits, max_wait_s)
        else:
            for i in waiting:
                self._answer(i, logits, wait=True)
            self.answered = waiting
        return logits

    def _track(self, row: StreamRow, feed: list[int]) -> None:
        """Where the row's stretch began (a prompt, or a hop's end marker and evidence: a feed of more
        than one token) and, at a query's start, how far into its stretch it came (``lead``)."""
        if len(feed) > 1:
            row.stretch_at = len(row.tokens) + len(feed)
        elif feed[0] in self.opens_query:
            self.lead = len(row.tokens) - row.stretch_at

    def _rules(self, want: PickRule | None) -> frozenset[int] | None:
        """The bans a new stream runs under (None: it asks for scores, which a pool needs too). Where
        it may open a query and the last query opened within ``SCORED_LEAD`` tokens of its stretch's
        start: scores from the start, so that the stream runs on into the query, sparing the request
        at its start."""
        if (not self.pushes_bans or want is None or want.pooled
                or (self.lead <= self.scored_lead and not self.opens_query <= want.bans)):
            return None
        return want.bans

    def take_answered(self) -> list[int]:
        """The rows the last step wrote logits for (a partial step's: those whose predictions had come)."""
        answered, self.answered = self.answered, []
        return answered

    def wake(self) -> None:
        """End a partial step's wait now (a search came back, a request arrived). Thread-safe."""
        self._woken = True
        self.arrived.set()

    def _gather(self, waiting: list[int], logits: torch.Tensor, max_wait_s: float | None) -> list[int]:
        """Answer each waiting row whose prediction has come; wait for the first while none has."""
        until = None if max_wait_s is None else time.perf_counter() + max_wait_s
        while True:
            self.arrived.clear()
            answered = [i for i in waiting if self._answer(i, logits, wait=False)]
            now = time.perf_counter()
            if answered or self._woken or (until is not None and now >= until):
                self._woken = False
                return answered
            due = min([self.rows[i].asked_at + self.timeout_s for i in waiting] + [until or float("inf")])
            self.arrived.wait(max(0.0, due - now) + 1e-3)  # until a token, a wake, or a row's own timeout

    def _answer(self, i: int, logits: torch.Tensor, wait: bool) -> bool:
        """Row ``i``'s prediction into ``logits[i]``: True once it is there (or the row failed: its
        logits zeros, ``row_errors``); False while it has not come (``wait`` False)."""
        row = self.rows[i]
        try:
            prediction = self._next(row, wait)
            if prediction is not None and row.bans and prediction.token in row.bans:
                row.bans = None  # a ban the server did not hold to (a bias too weak): this position from the scores
                self._open(row)
                prediction = self._next(row, wait)
            if prediction is None:
                return False
            if row.want is not None and (row.want.picks(prediction.token) or (
                    row.bans is None and row.want.outweighs(prediction.token, prediction.top, BELOW_TOP))):
                self._check_ids([prediction.token, *(t for t, _ in prediction.top)])
                self.picks[i] = prediction.token  # the engine's greedy pick under its rules: no scores needed
            else:
                self._write_scores(logits[i], prediction.top)
        except RemoteError as e:  # this row's request failed: the others go on
            self.row_errors[i] = str(e)
            logits[i].numpy().fill(0.0)
            if row.stream is not None:
                row.stream.close()
            row.stream = row.next = None
        row.awaiting = None
        return True

    def pause(self, rows: list[int]) -> None:
        """These rows wait (for their search): their streams close, the next step opens new ones."""
        for i in rows:
            row = self.rows[i]
            if row.stream is not None:
                row.stream.close()
                row.stream = None

    def take_picks(self) -> dict[int, int]:
        """The last step's tokens the server picked that the row's bans do not ban, by row: the
        engine's greedy pick under those bans is the server's, so it takes them as they are
        (``Sampler.sample``'s ``picked``; their logits rows are left unwritten)."""
        picks, self.picks = self.picks, {}
        return picks

    def take_row_errors(self) -> dict[int, str]:
        errors, self.row_errors = self.row_errors, {}
        return errors

    def _open_all(self, rows: list[StreamRow]) -> None:
        """New streams for these rows, all sent before any is waited for."""
        for row in rows:
            self._open(row)

    def _open(self, row: StreamRow) -> None:
        if row.stream is not None:
            row.stream.close()
        unscored = row.bans is not None
        request = partial(self.server.stream_completion, list(row.tokens), self._predict_n(row.tokens),
                          0 if unscored else self.top_logprobs, row.slot, banned=sorted(row.bans or ()),
                          stop=self.stop_text + self.opens_query_text if unscored else self.stop_text)
        stop_after = self.stop_after | self.opens_query if unscored else self.stop_after
        row.stream = ServerStream(request, stop_after, self.arrived.set)
        self._opened(row)

    def _opened(self, row: StreamRow) -> None:
        row.next, row.asked_at = None, time.perf_counter()
        self.calls += 1

    def _next(self, row: StreamRow, wait: bool = True) -> Prediction | None:
        """The row's next prediction (None: not come yet, where ``wait`` is False; ``wait``: up to
        the timeout). A stream that ended (its ``max_tokens`` spent, or closed after a stop token the
        engine did not take) is followed by a new one, once."""
        while True:
            fresh = row.next is None
            prediction = row.stream.next(self.timeout_s) if wait else row.stream.next(block=False)
            if prediction is PENDING:
                if time.perf_counter() - row.asked_at > self.timeout_s:
                    raise RemoteError(f"the server sent no token for {self.timeout_s:g}s")
                return None
            if prediction is not None:
                if fresh and row.stream.info is not None:
                    row.info = dict(row.stream.info)
                row.next, row.ended = prediction, 0
                return prediction
            row.ended += 1
            if row.ended > 1:
                raise RemoteError("the server ended a stream without a token (context full on the server side?)")
            self._open(row)

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
