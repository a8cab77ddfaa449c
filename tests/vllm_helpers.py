"""A stand-in for vLLM's ``AsyncLLM`` over a local HF model, and stand-ins for its request types.

The stand-in types have the shapes of vLLM 0.33.0's (fields, their order, keyword names). What it
honours, as vLLM's V1 engine does:

* ``generate(TokensPrompt(prompt_token_ids=...), SamplingParams, request_id)``: greedy decoding of
  ``max_tokens`` tokens, each with its top ``logprobs`` log-probabilities (log-softmax of the raw
  logits, plus the sampled token), stopping on EOS (unless ``ignore_eos``) or ``stop_token_ids``;
  outputs in ``output_kind`` CUMULATIVE, DELTA or FINAL_ONLY.
* the prefix cache: ``num_cached_tokens`` is the longest prefix, in whole ``block_size`` blocks,
  that an earlier request computed (a fully cached prompt still computes its last token); that
  prefix's KV is copied from the earlier request and only the rest is computed.
* resumable requests: a prompt that is an async generator of ``StreamingInput`` is one session.
  Each chunk is prefilled onto the KV the session kept and decodes under the chunk's own params,
  one output per token as it is decoded (cancelling the reader aborts the decode; the prefix cache
  keeps what it computed);
  the last sampled token of a chunk gets no KV and is dropped, so the session's tokens are exactly
  the chunks sent. ``num_cached_tokens`` is set once, by the first chunk's prefix-cache lookup, and
  every later output of the session repeats it; ``prompt_token_ids`` is the chunks' prompts joined.
  Outputs at a chunk's end carry ``finish_reason`` with ``finished=False``; the output stream ends
  once the input generator has returned. Stop strings, ``n > 1`` and FINAL_ONLY are refused, as
  vLLM refuses them for streaming input.
* with ``logits_processors`` (classes with vLLM's V1 interface) they see a ``BatchUpdate`` adding the
  request when a decode starts (a chunk re-adds it with the session so far as its prompt and a new
  output list, and so does a decode that resumes after another one ran in between), ``None`` at
  each further position while the live output list grows, and one removing it when the decode ends.

It records every request, the sessions it ended and how many requests were waiting to run at once.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from rig_decode.engine.vllm_api import VllmApi
from rig_decode.models.cache_arg import cache_kw

from .remote_helpers import _common_prefix


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None
    """Taken, not applied: a stop string ends nothing here (the resubmit bench cuts at it itself)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    flat_logprobs: bool = False
    n: int = 1
    extra_args: dict | None = None

    def __post_init__(self):  # the checks of vLLM's SamplingParams._verify_args that the runner could trip
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")


def TokensPrompt(**kwargs) -> dict:  # noqa: N802 - vLLM's TokensPrompt is a TypedDict
    if set(kwargs) - {"prompt_token_ids", "cache_salt"}:
        raise TypeError(f"unexpected TokensPrompt keys {sorted(kwargs)}")
    return dict(kwargs)


@dataclass
class StreamingInput:
    prompt: dict
    sampling_params: SamplingParams | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: object = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = field(default=None, kw_only=True)


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: list[int]
    added: list[tuple]
    """``(index, params, prompt_tok_ids, output_tok_ids)``; ``output_tok_ids`` is the live list."""
    moved: list[tuple[int, int, MoveDirectionality]]


@dataclass
class AsyncEngineArgs:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    seed: int | None = 0
    max_logprobs: int = 20
    quantization: str | None = None
    logits_processors: list | None = None


@dataclass
class _Session:
    cache: DynamicCache
    tokens: list[int] = field(default_factory=list)


class FakeAsyncLLM:
    def __init__(self, model, eos_id: int, *, block_size: int = 16, max_model_len: int = 2048,
                 logits_processors=(), engine_args: AsyncEngineArgs | None = None, steer=None):
        self.model, self.eos_id, self.block_size, self.max_model_len = model, eos_id, block_size, max_model_len
        self.engine_args = engine_args
        self.steer = steer
        self._decoding = None
        """``steer(context) -> token | None``: a model trained to write what the engine will take there."""
        self.logits_processors = [cls(None, torch.device("cpu"), False) for cls in logits_processors]
        self.computed: list[tuple[list[int], DynamicCache]] = []  # what the prefix cache holds, newest last
        self.requests: list[dict] = []
        self.sessions_open: set[str] = set()
        self.sessions_ended: list[str] = []
        self.waiting = 0
        self.max_waiting = 0
        self.shut_down = False

    # -- the AsyncLLM surface ----------------------------------------------------------------------

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str):
        if isinstance(prompt, AsyncGenerator):  # as AsyncLLM.add_request tells streaming input apart
            async for out in self._session(prompt, sampling_params, request_id):
                yield out
            return
        ids = list(prompt["prompt_token_ids"])
        self._check(ids, sampling_params)
        cached, cache = (0, self._new_cache()) if prompt.get("cache_salt") else self._prefix_hit(ids)
        await self._wait_turn()
        steps = list(self._decode(cache, ids[cached:], ids, sampling_params))
        tokens, logprobs, reason = [t for t, *_ in steps], [p for _, p, *_ in steps], steps[-1][2]
        self._remember(ids + tokens[:-1], cache)
        self.requests.append({"id": request_id, "kind": "prefix", "prompt_len": len(ids), "cached": cached,
                              "max_tokens": sampling_params.max_tokens, "extra_args": sampling_params.extra_args})
        for out in self._outputs(request_id, ids, tokens, logprobs, reason, cached, sampling_params.output_kind,
                                 finished=True):
            yield out

    def shutdown(self, timeout: float | None = None) -> None:
        self.shut_down = True

    # -- sessions -----------------------------------------------------------------------------------

    async def _session(self, inputs, params: SamplingParams, request_id: str):
        self._check_streaming(params)
        session, prompt_ids, reported, new, decoded = None, [], 0, [], []
        self.sessions_open.add(request_id)
        try:
            async for chunk in inputs:
                sp = chunk.sampling_params or params
                self._check_streaming(sp)
                new = list(chunk.prompt["prompt_token_ids"])
                prompt_ids += new
                if session is None:  # the first chunk is looked up in the prefix cache; vLLM reports that figure
                    cached, cache = self._prefix_hit(new)  # for the whole session (its prefill stats are taken once)
                    session, reported = _Session(cache, new[:cached]), cached
                    new = new[cached:]
                else:
                    cached = len(session.tokens)
                self._check(session.tokens + new, sp)
                sent = len(chunk.prompt["prompt_token_ids"])
                self.requests.append({"id": request_id, "kind": "chunk", "chunk_len": sent, "cached": cached,
                                      "reported": reported, "max_tokens": sp.max_tokens, "extra_args": sp.extra_args,
                                      "stop_token_ids": sp.stop_token_ids, "decoded": 0})
                await self._wait_turn()
                context, decoded = session.tokens + new, []
                # tokens stream out as they are decoded; an abort (the reader cancelled) stops the decode
                for tok, position, reason, done in self._decode(session.cache, new, context, sp):
                    self.requests[-1]["decoded"] += 1
                    decoded.append(tok)
                    if done:  # the chunk's last sampled token has no KV: the session drops it (vLLM's semantics)
                        session.tokens = context + decoded[:-1]
                        assert session.cache.get_seq_length() == len(session.tokens)
                        self._remember(list(session.tokens), session.cache)
                    yield self._output(request_id, list(prompt_ids), [tok], [position], reason, reported, finished=False)
                    if not done:
                        await asyncio.sleep(0)
        except (asyncio.CancelledError, GeneratorExit):  # aborted: vLLM's prefix cache keeps the full blocks computed
            if session is not None and session.cache.get_seq_length():
                n = session.cache.get_seq_length()
                self._remember((session.tokens + new + decoded)[:n], session.cache)
            raise
        finally:
            self.sessions_open.discard(request_id)
            self.sessions_ended.append(request_id)

    @staticmethod
    def _check_streaming(sp: SamplingParams) -> None:  # AsyncLLM._validate_streaming_input_sampling_params
        if not isinstance(sp, SamplingParams) or sp.n > 1 or sp.stop or sp.output_kind is RequestOutputKind.FINAL_ONLY:
            raise ValueError("Input streaming not currently supported for pooling models, n > 1, "
                             "request_kind = FINAL_ONLY or with stop strings.")

    # -- the model ----------------------------------------------------------------------------------

    def _check(self, ids: list[int], sp: SamplingParams) -> None:
        if not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        if sp.temperature != 0.0:
            raise ValueError("this stand-in decodes greedily only (temperature 0)")
        limit = self.engine_args.max_logprobs if self.engine_args else 20  # vLLM's ModelConfig.max_logprobs
        if sp.logprobs and limit != -1 and sp.logprobs > limit:
            raise ValueError(f"Requested sample logprobs of {sp.logprobs}, which is greater than max allowed: {limit}")
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len {self.max_model_len}")

    async def _wait_turn(self) -> None:
        """Let every request submitted in the same tick arrive first (vLLM would batch them)."""
        self.waiting += 1
        self.max_waiting = max(self.max_waiting, self.waiting)
        await asyncio.sleep(0)
        self.waiting -= 1

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _remember(self, tokens: list[int], cache: DynamicCache) -> None:
        self.computed = self.computed[-31:] + [(tokens, cache)]

    def _prefix_hit(self, ids: list[int]) -> tuple[int, DynamicCache]:
        """(tokens taken from the prefix cache, a cache holding their KV)."""
        cache, best, source = self._new_cache(), 0, None
        for tokens, held in self.computed:
            n = _common_prefix(tokens, ids)
            if n > best:
                best, source = n, held
        hit = min(best, len(ids) - 1) // self.block_size * self.block_size
        if hit:  # sessions keep growing their cache; the first ``hit`` columns are what was computed
            for i, layer in enumerate(source.layers):
                cache.update(layer.keys[:, :, :hit].clone(), layer.values[:, :, :hit].clone(), i)
        return hit, cache

    @torch.no_grad()
    def _forward(self, cache: DynamicCache, ids: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids]), **cache_kw(cache), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def _decode(self, cache, feed: list[int], context: list[int], sp: SamplingParams):
        """Greedy decoding, one ``(token, its logprobs, finish reason, last)`` at a time."""
        logits = self._forward(cache, feed)
        stop_ids = set(sp.stop_token_ids or ())
        output: list[int] = []
        me = object()
        try:
            for k in range(sp.max_tokens or 1):
                if self._decoding is not me:  # joining, or another request decoded in between: (re-)added
                    self._batch_update(BatchUpdate(1, removed=[], added=[(0, sp, list(context), output)], moved=[]))
                    self._decoding = me
                logp = torch.log_softmax(logits, -1)
                processed = self._processed(logits.clone())
                steered = self.steer(context + output) if self.steer is not None else None
                tok = int(processed.argmax()) if steered is None else steered
                top = torch.topk(logp, sp.logprobs or 1)
                position = {int(i): Logprob(float(v), r + 1) for r, (i, v) in enumerate(zip(top.indices, top.values))}
                position.setdefault(tok, Logprob(float(logp[tok])))
                output.append(tok)
                stop = (tok == self.eos_id and not sp.ignore_eos) or tok in stop_ids
                if stop or k + 1 == (sp.max_tokens or 1):
                    yield tok, position, "stop" if stop else "length", True
                    return
                yield tok, position, None, False
                logits = self._forward(cache, [tok])
                self._batch_update(None)  # same batch; the processors read the output list they were handed
        finally:
            self._batch_update(BatchUpdate(0, removed=[0], added=[], moved=[]))
            self._decoding = None

    def _batch_update(self, update: BatchUpdate | None) -> None:
        for lp in self.logits_processors:
            lp.update_state(update)

    def _processed(self, logits) -> torch.Tensor:
        row = logits[None]
        for lp in self.logits_processors:
            row = lp.apply(row)
        return row[0]

    def _output(self, request_id, prompt_ids, tokens, logprobs, reason, cached, finished: bool) -> RequestOutput:
        o = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs,
                             finish_reason=reason, stop_reason=tokens[-1] if reason == "stop" and tokens[-1] != self.eos_id
                             else None)
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_ids, prompt_logprobs=None,
                             outputs=[o], finished=finished and reason is not None, num_cached_tokens=cached)

    def _outputs(self, request_id, prompt_ids, tokens, logprobs, reason, cached, kind, finished: bool):
        """The RequestOutputs of one decode, one per token as the output processor sends them."""
        if kind is RequestOutputKind.FINAL_ONLY:
            yield self._output(request_id, prompt_ids, tokens, logprobs, reason, cached, finished)
            return
        for k in range(len(tokens)):
            lo = k if kind is RequestOutputKind.DELTA else 0
            yield self._output(request_id, prompt_ids, tokens[lo:k + 1], logprobs[lo:k + 1],
                               reason if k == len(tokens) - 1 else None, cached, finished)


def writes_like(seqs):
    """A ``steer`` for ``FakeAsyncLLM``: at a context that starts one of ``seqs`` (finished engine
    sequences), the token the engine took next there; the model's own pick in the prompt, in evidence
    and past the end. A stand-in for a model that writes its markers itself."""
    runs = []
    for s in seqs:
        own = [i >= len(s.prompt_ids) for i in range(len(s.token_ids))]
        for step in s.trace.retrieval_steps:
            own[step.position:step.position + step.evidence_tokens] = [False] * step.evidence_tokens
        runs.append((list(s.token_ids), own))

    def steer(context: list[int]) -> int | None:
        n = len(context)
        for ids, own in runs:
            if n < len(ids) and own[n] and ids[:n] == context:
                return ids[n]
        return None

    return steer


def fake_api(model, eos_id: int, *, streaming: bool = True, built: list | None = None,
             quantization_methods: tuple[str, ...] | None = None, **engine_kwargs) -> VllmApi:
    """A ``VllmApi`` whose ``AsyncLLM.from_engine_args`` builds a ``FakeAsyncLLM`` (appended to
    ``built``); ``streaming=False``: a vLLM without ``StreamingInput``; ``quantization_methods``:
    the ``quantization=`` names it accepts (None: unknown, as for a vLLM that does not list them)."""

    def from_engine_args(args: AsyncEngineArgs):
        procs = [_load(name) for name in args.logits_processors or ()]
        engine = FakeAsyncLLM(model, eos_id, max_model_len=args.max_model_len or 2048, logits_processors=procs,
                              engine_args=args, **engine_kwargs)
        if built is not None:
            built.append(engine)
        return engine

    return VllmApi(SamplingParams, TokensPrompt, RequestOutputKind, StreamingInput if streaming else None,
                   AsyncEngineArgs, SimpleNamespace(from_engine_args=from_engine_args), "fake", quantization_methods)


def _load(fqcn: str):
    """A logits-processor class by vLLM's ``module:Class`` name; without vLLM the marker processor
    class does not exist, and a stand-in with its body is used."""
    import importlib

    module, name = fqcn.split(":")
    found = getattr(importlib.import_module(module), name, None)
    return found if found is not None else StandInMarkerProcessor


class StandInMarkerProcessor:
    """``vllm_logits.RigMarkerLogitsProcessor`` without vLLM's base class."""

    def __init__(self, vllm_config, device, is_pin_memory):
        from rig_decode.engine.vllm_logits import MarkerLogitsState

        self.state = MarkerLogitsState()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        self.state.update(batch_update)

    def apply(self, logits):
        return self.state.apply(logits)
