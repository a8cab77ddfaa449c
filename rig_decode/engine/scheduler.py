"""The batch: which sequences wait, which run, and which row of the runner's cache each one is.

``running[i]`` is row ``i`` of the runner's batch, always: the scheduler is the only one that adds
rows to the runner (``admit``, ``move_spliced_rows``) or removes them (``drop_finished``), and it
changes ``running`` in the same call. Everything else reads the batch from ``running``.

Per step, in this order (``RigEngine.step``):

* ``expire``: cancelled or overdue sequences finish, queued or running; parked rows whose search
  is past ``retrieval_timeout_s`` are returned for the hop handler to serve without evidence;
* ``drop_finished``: finished rows leave the batch and free their cache;
* ``admit``: waiting sequences join while the batch size and the KV budget allow (a sequence is
  budgeted at its worst case: prompt, every token it may generate, every hop's evidence);
* ``move_spliced_rows`` (reference mode only): rows with evidence to add leave their cache and
  rejoin as new rows that prefill their whole token list;
* ``ready``: the rows with tokens to feed.

``add`` and ``cancel`` may come from other threads (the async front); the queues are locked.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from .options import EngineOptions
from .sequence import Sequence, SequenceStatus

WAITING, RUNNING, RETRIEVING = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.RETRIEVING


class Scheduler:
    def __init__(self, runner, options: EngineOptions):
        self.runner, self.opts = runner, options
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # row i of the runner's batch
        self.lock = threading.Lock()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def worst_case(self, s: Sequence) -> int:
        """KV tokens the sequence may come to hold: prompt, generation, and every hop's evidence."""
        hops = self.opts.max_iterations if s.max_iterations is None else s.max_iterations
        return len(s.prompt_ids) + s.max_new_tokens + hops * (self.opts.evidence_token_budget + 1)

    def add(self, seq: Sequence) -> None:
        with self.lock:
            clash = next((x for x in (*self.waiting, *self.running) if x.seq_id == seq.seq_id and not x.is_finished),
                         None)
            if clash is not None:
                raise ValueError(f"seq_id {seq.seq_id} is already in this engine" +
                                 (" (the same sequence twice)" if clash is seq else "") +
                                 ": give every sequence its own id")
            seq.arrival = time.perf_counter()
            if self.opts.deadline_s is not None:
                seq.deadline_at = seq.arrival + self.opts.deadline_s
            seq.status = WAITING
            self.waiting.append(seq)

    def cancel(self, seq_id: int) -> bool:
        with self.lock:
            for s in (*self.waiting, *self.running):
                if s.seq_id == seq_id and not s.is_finished:
                    s.cancelled = True
                    return True
        return False

    def take_all(self) -> list[Sequence]:
        """Empty the queue and the batch; the sequences they held (the caller resets the runner
        once it has finished them)."""
        with self.lock:
            seqs, self.waiting = [*self.waiting, *self.running], deque()
        self.running = []
        return seqs

    # -- the step's schedule, in order ---------------------------------------------------------------

    def expire(self, now: float) -> list[Sequence]:
        """Finish cancelled and overdue sequences; the parked rows whose search timed out."""
        with self.lock:
            for s in list(self.waiting):
                if s.cancelled or (s.deadline_at is not None and now > s.deadline_at):
                    self.waiting.remove(s)
                    s.finish("cancelled" if s.cancelled else "deadline", now)
        timed_out = []
        for s in self.running:
            if s.is_finished:
                continue
            if s.cancelled:
                s.finish("cancelled", now)
            elif s.deadline_at is not None and now > s.deadline_at:
                s.finish("deadline", now)
            elif s.status is RETRIEVING and now - s.parked_at > self.opts.retrieval_timeout_s:
                timed_out.append(s)
        return timed_out

    def drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self.running) if not s.is_finished]
        if len(keep) != len(self.running):
            self.runner.select(keep)
            self.running = [self.running[i] for i in keep]

    def admit(self, now: float) -> None:
        budget, new = self.opts.kv_budget_tokens, []
        with self.lock:
            while self.waiting and len(self.running) + len(new) < self.opts.max_batch_size:
                s = self.waiting[0]
                if budget is not None:
                    rows = len(self.running) + len(new) + 1
                    widest = max(self.worst_case(x) for x in (*self.running, *new, s))
                    if rows * widest > budget and (self.running or new):
                        break  # queue it: the batch is full for this budget
                new.append(self.waiting.popleft())
        if not new:
            return
        for s, rest in zip(new, self.runner.add_rows([s.prompt_ids for s in new])):
            s.status, s.pending = RUNNING, list(rest)
            s.trace.queue_ms = (now - s.arrival) * 1e3
            self.running.append(s)

    def move_spliced_rows(self) -> None:
        """Reference mode: rows with evidence to add leave the cache and rejoin as new rows that
        prefill their whole token list (marker, evidence and all) from scratch."""
        moved = [s for s in self.running if s.status is RUNNING and s.has_evidence_pending]
        if not moved:
            return
        keep = [i for i, s in enumerate(self.running) if s not in moved]
        self.runner.select(keep)
        self.running = [self.running[i] for i in keep]
        for s, rest in zip(moved, self.runner.add_rows([s.kept_ids for s in moved], share_prefix=False)):
            s.pending = list(rest)
            self.running.append(s)

    def ready(self) -> list[int]:
        """The rows with tokens to feed (parked rows feed nothing)."""
        return [i for i, s in enumerate(self.running) if s.status is RUNNING and s.pending]
