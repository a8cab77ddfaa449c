"""Serve an app from a background thread (benchmarks, tests, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 30.0):
    """Run ``app`` with uvicorn on ``host:port`` (a free port by default); yields the base URL and
    stops the server on exit."""
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="rig-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
