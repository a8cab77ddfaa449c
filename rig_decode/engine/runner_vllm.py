"""A model runner over vLLM in this process (``AsyncLLM``, V1 engine): ``engine.backend: vllm``.

vLLM runs on its own asyncio loop, on a background thread (``VllmHost``). Like the remote runners,
the engine sees each position's top ``top_logprobs`` log-probabilities as sparse logits and does all
masking and sampling itself; vLLM decodes greedily. Two modes (``engine.vllm.mode``; ``auto`` takes
``stream`` where vLLM has ``StreamingInput``), built by ``vllm_runner_on``:

* ``stream`` (``runner_vllm_stream.py``): one resumable request per row, kept while the row lives;
  vLLM decodes freely between hops and each chunk stops at the end delimiter, so a hop is one call
  whose chunk (marker token + evidence) is prefilled alone onto the KV the request kept.
* ``prefix`` (``VllmRunner`` here): a new request per call with the row's full token ids,
  ``max_tokens=lookahead``, and the remote runner's lookahead logic: steps that take vLLM's
  predicted token cost no call. Each engine step hands vLLM every row that needs the model at once,
  as concurrent requests, so vLLM schedules them as one batch. vLLM's automatic prefix cache holds
  the earlier tokens (full blocks), so a hop's call prefills the evidence and the partial last block.

Each call's prompt accounting goes into the hop's trace (``row_info``): ``mode``, ``cache_n`` tokens
not evaluated, ``prompt_n`` tokens evaluated, and vLLM's ``num_cached_tokens`` as reported. In prefix
mode ``cache_n`` is that figure. In stream mode ``cache_n`` is the tokens the session kept, or on
a session's first chunk the prefix-cache hits vLLM reported: vLLM sets ``num_cached_tokens`` once,
from a request's first scheduled prefill, and every later output of the session repeats that figure.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass

from .runner_remote import RemoteRow, RemoteRunner
from .servers import Completion
from .runner_vllm_stream import VllmStreamRunner
from .vllm_api import VllmApi, engine_args_kwargs, load_vllm_api, resolve_mode
from .vllm_host import IDS_ONLY, EventLoopThread, NoServer, VllmError, VllmHost, predictions, rule_args


_ids = itertools.count()


class VllmRunner(RemoteRunner):
    """``prefix`` mode (see the module docstring): the remote runner's lookahead over vLLM requests."""

    mode = "prefix"

    def __init__(self, host: VllmHost, vocab_size: int, *, top_logprobs: int = 20, lookahead: int = 16,
                 context_limit: int = 8192, marker_rules=None, timeout_s: float | None = None):
        self.host, self.marker_rules, self.timeout_s = host, marker_rules, timeout_s
        super().__init__(NoServer(), vocab_size, lookahead=lookahead, top_logprobs=top_logprobs,
                         context_limit=context_limit)

    @property
    def engine(self):
        return self.host.engine

    def add_rows(self, prompts: list[list[int]], share_prefix: bool = True) -> list[list[int]]:
        feeds = super().add_rows(prompts, share_prefix)
        for row, p in zip(self.rows[len(self.rows) - len(prompts):], prompts):
            row.prompt_len = len(p)
        return feeds

    def _new_row(self) -> _PrefixRow:
        return _PrefixRow()

    def _ask(self, ask: list[int]) -> None:
        rows = [self.rows[i] for i in ask]

        async def all_rows():
            return await asyncio.gather(*(self._request_one(row) for row in rows))

        self._take(ask, self.host.loop.run(all_rows(), self.timeout_s))

    async def _request_one(self, row: _PrefixRow) -> tuple[Completion, dict]:
        api, tokens = self.host.api, list(row.tokens)
        params = api.SamplingParams(max_tokens=self._predict_n(tokens), temperature=0.0, logprobs=self.top_logprobs,
                                    output_kind=api.RequestOutputKind.FINAL_ONLY, **IDS_ONLY,
                                    **rule_args(self.marker_rules, row.prompt_len))
        final = None
        async for out in self.engine.generate(api.TokensPrompt(prompt_token_ids=tokens), params, f"rig-p{next(_ids)}"):
            final = out
        if final is None:
            raise VllmError("vLLM returned no output for a request")
        o = final.outputs[0]
        cached = getattr(final, "num_cached_tokens", None)
        completion = Completion(predictions(list(o.token_ids), list(o.logprobs or []), self.top_logprobs), cached,
                                None if cached is None else len(tokens) - cached,
                                getattr(final, "prompt_token_ids", None))
        info = self._accept(tokens, completion)
        info.update(mode="prefix", num_cached_tokens=cached)
        return completion, info

    def close(self) -> None:
        self.rows = []
        self.host.close()
        super().close()


@dataclass(slots=True)
class _PrefixRow(RemoteRow):
    prompt_len: int = 0


def vllm_runner_on(engine, api: VllmApi, vocab_size: int, *, mode: str = "auto", top_logprobs: int = 20,
                   lookahead: int = 16, context_limit: int = 8192, marker_rules=None,
                   loop: EventLoopThread | None = None, owns_loop: bool | None = None, owns_engine: bool = False,
                   timeout_s: float | None = None):
    """The runner of ``mode`` (``auto``: ``stream`` where vLLM has ``StreamingInput``) over an
    ``AsyncLLM``-like ``engine``; ``api`` supplies the request types (``VllmApi``). ``marker_rules``:
    a ``vllm_logits.MarkerRules`` every request carries, for the optional marker logits processor."""
    mode = resolve_mode(mode, api)
    host = VllmHost(engine, api, loop, owns_loop, owns_engine)
    if mode == "stream":
        return VllmStreamRunner(host, vocab_size, top_logprobs=top_logprobs, context_limit=context_limit,
                                marker_rules=marker_rules, timeout_s=timeout_s)
    return VllmRunner(host, vocab_size, top_logprobs=top_logprobs, lookahead=lookahead,
                      context_limit=context_limit, marker_rules=marker_rules, timeout_s=timeout_s)


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
    return vllm_runner_on(engine, api, tokenizer_len, mode=mode, top_logprobs=v.top_logprobs, lookahead=v.lookahead,
                          context_limit=v.max_model_len, marker_rules=rules, loop=loop, owns_loop=True,
                          owns_engine=owns)
