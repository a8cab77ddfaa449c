"""vLLM's engine on a loop thread of its own (``VllmHost``), and what both vLLM runners read of its
outputs (``predictions``)."""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import Future

from .servers import Prediction, RemoteError
from .vllm_api import VllmApi


SHUTDOWN_TIMEOUT_S = 30.0
"""How long vLLM's engine process may take to exit once told to: its default (5 s) is shorter than a
CPU worker's teardown, which then ends with a force-kill warning."""


IDS_ONLY = {"detokenize": False, "flat_logprobs": True}
"""``SamplingParams`` of every rig request: the engine reads token ids and log-probabilities only, so
vLLM's front end (in this process, beside the engine) neither detokenises the output and every
top-k candidate nor builds a dict per position."""


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


class VllmHost:
    """vLLM's engine and the loop thread it runs on, which a runner drives. ``loop``: a new one by
    default, closed with the host; one passed in is closed only with ``owns_loop``. ``owns_engine``:
    ``close`` shuts the engine down."""

    def __init__(self, engine, api: VllmApi, loop: EventLoopThread | None = None, owns_loop: bool | None = None,
                 owns_engine: bool = False):
        self.engine, self.api = engine, api
        self.owns_loop = loop is None if owns_loop is None else owns_loop
        self.loop = loop or EventLoopThread()
        self.owns_engine = owns_engine
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.owns_engine and hasattr(self.engine, "shutdown"):
                engine, self.engine = self.engine, None
                self.loop.run(_call(engine.shutdown, timeout=SHUTDOWN_TIMEOUT_S), timeout=SHUTDOWN_TIMEOUT_S + 30)
                # AsyncLLM.__del__ shuts down once more: let that happen now, not at interpreter exit,
                # where vLLM's module globals are already gone (a TypeError printed on the way out)
                del engine
                gc.collect()
        finally:
            if self.owns_loop:
                self.loop.close()


def predictions(ids: list[int], logprobs: list, top_logprobs: int) -> list[Prediction]:
    """vLLM's ``logprobs``: per position, a mapping token id -> ``Logprob`` (or a float); the top
    ``logprobs`` plus the sampled token. A ``FlatLogprobs`` (``flat_logprobs=True``) iterates the same."""
    if len(logprobs) < len(ids):
        raise VllmError("vLLM returned tokens without logprobs: is SamplingParams.logprobs honoured?")
    preds = []
    for tok, position in zip(ids, logprobs):
        pairs = [(int(t), float(getattr(lp, "logprob", lp))) for t, lp in (position or {}).items()]
        pairs.sort(key=lambda kv: -kv[1])
        preds.append(Prediction(int(tok), pairs[:top_logprobs] or [(int(tok), 0.0)]))
    return preds


def rule_args(marker_rules, prompt_len: int) -> dict:
    """``SamplingParams`` keywords carrying the marker rules (``vllm_logits.MarkerRules``, or None:
    none), counted from where the request's own tokens start."""
    return {} if marker_rules is None else {"extra_args": marker_rules.to_extra_args(count_from=prompt_len)}


class NoServer:
    """The remote runners' server: vLLM is asked through the runner itself, takes any number of rows
    and reports no context limit of its own."""

    def context_limit(self) -> None:
        return None

    def total_slots(self) -> None:
        return None

    def close(self) -> None:
        pass
