"""What a streaming runner's readers hand the engine: one inbox per stream (llama-server, OpenAI
servers) or per resumable request (vLLM), its predictions put by a reader and taken by the engine."""

from __future__ import annotations

import queue

from .servers import RemoteError

END = object()
"""What a stream's queue holds after its last prediction."""

PENDING = object()
"""What a stream gives, asked without waiting, while its next prediction has not come."""


class Inbox:
    """A stream's predictions as a reader thread puts them and the engine takes them, then ``END`` (an
    error, then ``END``, where it failed); ``notify`` is called after every put (a partial step's)."""

    who = "the server"
    error = RemoteError

    def __init__(self, notify=None):
        self.predictions: queue.Queue = queue.Queue()
        self.notify = notify

    def put(self, item) -> None:
        self.predictions.put(item)
        if self.notify is not None:
            self.notify()

    def next(self, timeout: float | None = None, block: bool = True):
        """The next prediction (None: the stream ended; ``PENDING``: none yet, where ``block`` is
        False); the stream's error, raised."""
        try:
            item = self.predictions.get(block=block, timeout=timeout)
        except queue.Empty:
            if not block:
                return PENDING
            raise self.error(f"{self.who} sent no token for {timeout:g}s") from None
        if item is END:
            self.predictions.put(END)  # stays ended
            return None
        if isinstance(item, BaseException):
            raise item if isinstance(item, self.error) else self.error(f"{type(item).__name__}: {item}")
        return item
