"""What a streaming runner's readers hand the engine: one inbox per stream (llama-server, OpenAI
servers) or per resumable request (vLLM), its predictions put by a reader and taken by the engine."""

from __future__ import annotations

import queue
import socket
import threading

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


RUN_AHEAD = 16
"""Predictions a stream may hold that the engine has not taken yet. The server decodes as fast as it
can, whatever the engine's pace (at a high concurrency on shared cores, faster): past this, the
stream closes itself, and the engine opens a new one (its prompt cached) when it has caught up. So
a forced token wastes at most this many decoded tokens, not everything up to the end (a hop wastes
next to none: the stream closes at the end delimiter, ``stop_after``)."""


class ServerStream(Inbox):
    """One streamed completion: a thread reads the server's predictions into the inbox, at most
    ``RUN_AHEAD`` ahead of the engine."""

    def __init__(self, request, stop_after: frozenset[int] = frozenset(), notify=None):
        """``request(cancelled=, opened=)``: the server's ``stream_completion`` with its arguments."""
        super().__init__(notify)
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
                    self.put(p)
                    if p.token in stop_after:  # an end delimiter: the row parks for its search next
                        self.closed = True
                if self.closed or self.predictions.qsize() >= RUN_AHEAD:  # (or far enough ahead of the engine)
                    self.closed = True
                    break
        except BaseException as e:  # noqa: BLE001 - the engine's thread raises it for this row
            self.put(e)
        self.put(END)

    def _opened(self, response) -> None:
        self.response = response
        if self.closed:  # closed before the server answered
            self.close()

    def close(self) -> None:
        """Stop reading and close the connection now: its socket is shut down first, which wakes the
        reader (with an error it ignores) and tells the server at once (closing alone leaves the
        connection open while the reader waits in it, and the server decoding on)."""
        self.closed = True
        response = self.response
        if response is not None:
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
                response.close()
            except Exception:  # noqa: BLE001 - closed under a reader, or twice: it is closed either way
                pass
