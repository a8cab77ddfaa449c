"""A model runner backed by a completion server (llama.cpp's ``llama-server``, vLLM's OpenAI server).

The engine drives every backend through the same runner interface: ``add_rows`` / ``step`` (feed
each row its new tokens, get next-token logits) / ``select``. This runner answers ``step`` from a
remote server without ever sending text:

* each request carries the row's **token ids** (prompt, sampled tokens, evidence) as the prompt,
  so nothing is re-tokenised and the server's prefix cache holds everything but the new tokens;
* the server predicts ``lookahead`` tokens greedily and returns, for each, its top ``top_logprobs``
  log-probabilities. A step is served from that lookahead as long as the engine picks the token
  the server predicted; the row's next-token "logits" are the top log-probabilities, every other
  token set far below them. The engine's logits processors (hop budget, query cap, newline rule,
  citations, gate) and sampling then run unchanged, and whenever they pick another token (a
  banned marker, a forced delimiter, a spliced evidence block) the lookahead is dropped and the
  next step asks the server again from the new token list - one round trip per hop, not per token.

Greedy decoding through this runner picks the same tokens as the server's model would under the
engine's masks, except where a mask bans every one of the top tokens (then the best unlisted token
is unknown; raise ``top_logprobs``). Sampling at temperature > 0 draws from the top tokens only.

After each call the runner keeps what the server said about the prompt: how many tokens it took
from its cache and how many it evaluated, and whether its view of the prompt differs from the ids
sent (a server that re-tokenised). The engine puts these into the trace of the hop they follow.
"""

from __future__ import annotations

import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


class RemoteError(RuntimeError):
    """The completion server refused a request or answered something this runner cannot use."""


@dataclass(slots=True)
class Prediction:
    """One position the server predicted: its token and the top log-probabilities it came from."""

    token: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Completion:
    predictions: list[Prediction]
    cache_n: int | None = None
    """Prompt tokens the server took from its cache."""
    prompt_n: int | None = None
    """Prompt tokens the server evaluated."""
    prompt_ids: list[int] | None = None
    """The prompt as the server tokenised it, where it reports it."""
    prompt_ms: float | None = None
    """The server's time to evaluate the prompt tokens it did not have cached."""


class HttpServer:
    """Shared HTTP plumbing: one keep-alive connection pool, errors that name the server."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def post(self, path: str, body: dict) -> dict:
        import httpx

        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as e:
            raise RemoteError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise RemoteError(f"{self.base_url}{path} answered {r.status_code}: {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise RemoteError(f"{self.base_url}{path} answered something that is not JSON: {r.text[:200]!r}") from None

    def stream(self, path: str, body: dict, cancelled=lambda: False, opened=None):
        """``POST`` a streaming request: each Server-Sent Event's JSON, until ``[DONE]``, the end, or
        ``cancelled()`` (checked at every event; leaving closes the connection: the server stops).
        ``opened(response)`` gets the open response, which another thread may close."""
        import httpx

        try:
            with self.http.stream("POST", path, json=body) as r:
                if opened is not None:
                    opened(r)
                if r.status_code != 200:
                    raise RemoteError(f"{self.base_url}{path} answered {r.status_code}: {r.read()[:300]!r}")
                for line in r.iter_lines():
                    if cancelled():
                        return
                    if not line.startswith("data:"):
                        if line.startswith("error:"):
                            raise RemoteError(f"{self.base_url}{path} streamed an error: {line[:300]}")
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise RemoteError(f"{self.base_url}{path} streamed something that is not JSON: "
                                          f"{data[:200]!r}") from None
                    if not isinstance(event, dict) or "error" in event:
                        raise RemoteError(f"{self.base_url}{path} streamed an error: {data[:300]}")
                    yield event
        except (httpx.HTTPError, httpx.StreamError) as e:
            if not cancelled():
                raise RemoteError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None

    def get(self, path: str) -> dict | None:
        import httpx

        try:
            r = self.http.get(path)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def close(self) -> None:
        self.http.close()


class LlamaCppServer(HttpServer):
    """llama.cpp's ``llama-server``, native ``/completion`` endpoint: the prompt as a list of token
    ids (no BOS is added to one), ``cache_prompt`` keeps the slot's KV for the common prefix,
    ``return_tokens`` and ``n_probs`` give ids and top log-probabilities, ``timings`` the cache use.
    Run it with at least as many slots (``-np``) as rows decode at once: it serves each request from
    the slot whose cache shares the longest prefix with it (``slot`` pins one instead)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0, slot: int | None = None):
        super().__init__(base_url, api_key, timeout_s)
        self.slot = slot

    def context_limit(self) -> int | None:
        props = self.get("/props") or {}
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") or props.get("n_ctx")
        return int(n_ctx) if n_ctx else None

    def total_slots(self) -> int | None:
        return (self.get("/props") or {}).get("total_slots")

    def stream_completion(self, prompt_ids: list[int], n_predict: int, n_probs: int, slot: int | None = None,
                          cancelled=lambda: False, opened=None):
        """The completion as it decodes: ``(predictions, info)`` per event (``info``: the prompt's
        accounting, on the events that carry timings); ``slot`` pins the request to a slot."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "n_probs": n_probs, "temperature": 0.0,
                "cache_prompt": True, "return_tokens": True, "repeat_penalty": 1.0, "stream": True,
                "timings_per_token": True}
        if slot is not None or self.slot is not None:
            body["id_slot"] = self.slot if slot is None else slot
        for event in self.stream("/completion", body, cancelled, opened):
            tokens, probs = event.get("tokens") or [], event.get("completion_probabilities") or []
            if len(probs) < len(tokens):
                raise RemoteError(f"{self.base_url}/completion streamed tokens without their probabilities: "
                                  "llama-server too old for return_tokens / n_probs?")
            preds = [Prediction(int(tok), [(int(t["id"]), float(t["logprob"])) for t in p.get("top_logprobs", [])]
                                or [(int(tok), 0.0)]) for tok, p in zip(tokens, probs)]
            timings = event.get("timings") or {}
            info = ({"cache_n": timings.get("cache_n"), "prompt_n": timings.get("prompt_n"),
                     "prompt_ms": timings.get("prompt_ms")} if "prompt_n" in timings else None)
            yield preds, info

    def complete(self, prompt_ids: list[int], n_predict: int, n_probs: int, seed: int = 0) -> Completion:
        body = {"prompt": prompt_ids, "n_predict": n_predict, "n_probs": n_probs, "temperature": 0.0,
                "seed": seed, "cache_prompt": True, "return_tokens": True, "repeat_penalty": 1.0,
                "stream": False}
        if self.slot is not None:
            body["id_slot"] = self.slot
        out = self.post("/completion", body)
        tokens, probs = out.get("tokens"), out.get("completion_probabilities")
        if tokens is None or probs is None:
            raise RemoteError(f"{self.base_url}/completion returned no 'tokens' or 'completion_probabilities': "
                              "llama-server too old for return_tokens / n_probs?")
        preds = []
        for tok, p in zip(tokens, probs):
            top = [(int(t["id"]), float(t["logprob"])) for t in p.get("top_logprobs", [])]
            preds.append(Prediction(int(tok), top or [(int(tok), 0.0)]))
        timings = out.get("timings") or {}
        return Completion(preds, timings.get("cache_n"), timings.get("prompt_n"), prompt_ms=timings.get("prompt_ms"))


class OpenAICompletionServer(HttpServer):
    """An OpenAI-compatible ``/v1/completions`` that takes token-id prompts and returns token ids
    (vLLM: ``return_token_ids``, ``logprobs`` keyed ``token_id:N`` with ``return_tokens_as_token_ids``,
    cache use in ``usage.prompt_tokens_details.cached_tokens`` with ``--enable-prompt-tokens-details``)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout_s: float = 120.0):
        super().__init__(base_url, api_key, timeout_s)
        self.model = model

    def context_limit(self) -> int | None:
        models = (self.get("/v1/models") or {}).get("data") or []
        for m in models:
            if self.model is None or m.get("id") == self.model:
                self.model = self.model or m.get("id")
                return m.get("max_model_len")
        return None

    def total_slots(self) -> int | None:
        return None  # vLLM schedules requests itself; its prefix cache needs no pinning

    def stream_completion(self, prompt_ids: list[int], n_predict: int, n_probs: int, slot: int | None = None,
                          cancelled=lambda: False, opened=None):
        """The completion as it decodes (see ``LlamaCppServer.stream_completion``); the prompt's
        accounting comes from vLLM's per-chunk usage (``continuous_usage_stats``)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": n_predict, "temperature": 0.0,
                "logprobs": n_probs, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        for event in self.stream("/v1/completions", body, cancelled, opened):
            info = None
            usage = event.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                info = {"cache_n": cached, "prompt_n": len(prompt_ids) - cached}
            for choice in event.get("choices") or []:
                tokens = choice.get("token_ids")
                if tokens is None:
                    raise RemoteError(f"{self.base_url}/v1/completions streamed no token_ids: the server must "
                                      "accept return_token_ids and logprobs (vLLM does)")
                tops = (choice.get("logprobs") or {}).get("top_logprobs") or [None] * len(tokens)
                yield [Prediction(int(tok), _openai_top(top) or [(int(tok), 0.0)])
                       for tok, top in zip(tokens, tops)], info
                info = None
            if info is not None:
                yield [], info

    def complete(self, prompt_ids: list[int], n_predict: int, n_probs: int, seed: int = 0) -> Completion:
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": n_predict, "temperature": 0.0,
                "seed": seed, "logprobs": n_probs, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False}
        out = self.post("/v1/completions", body)
        try:
            choice = out["choices"][0]
            tokens = choice["token_ids"]
            tops = choice["logprobs"]["top_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise RemoteError(f"{self.base_url}/v1/completions returned no token_ids or top_logprobs: the server "
                              "must accept return_token_ids and logprobs (vLLM does)") from None
        preds = [Prediction(int(tok), _openai_top(top) or [(int(tok), 0.0)]) for tok, top in zip(tokens, tops)]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return Completion(preds, cached, None if cached is None else len(prompt_ids) - cached,
                          choice.get("prompt_token_ids"))


def _openai_top(top: dict | None) -> list[tuple[int, float]]:
    """vLLM's ``{"token_id:N": logprob}`` (``return_tokens_as_token_ids``), best first."""
    return sorted(((int(k.rsplit(":", 1)[-1]), float(v)) for k, v in (top or {}).items()), key=lambda kv: -kv[1])


def make_server(api: str, base_url: str, *, model: str | None = None, api_key: str | None = None,
                timeout_s: float = 120.0):
    """A server client for ``api``: ``llama.cpp``, ``openai``, or ``auto`` (``llama-server`` answers
    ``/props``; anything else is taken for an OpenAI-compatible server)."""
    if api == "auto":
        probe = LlamaCppServer(base_url, api_key, timeout_s)
        if probe.get("/props") is not None:
            return probe
        probe.close()
        api = "openai"
    if api == "llama.cpp":
        return LlamaCppServer(base_url, api_key, timeout_s)
    if api == "openai":
        return OpenAICompletionServer(base_url, model, api_key, timeout_s)
    raise ValueError(f"unknown remote api {api!r}: choose llama.cpp, openai or auto")


@dataclass(slots=True)
class RemoteRow:
    tokens: list[int] = field(default_factory=list)
    ahead: deque = field(default_factory=deque)
    """Predictions for the positions after ``tokens``, best guess of what comes next."""
    info: dict | None = None
    """What the server said about the prompt of this row's last call (until ``row_info`` takes it)."""


class RemoteRunner:
    """The engine's runner interface over a completion server (see the module docstring)."""

    def __init__(self, server, vocab_size: int, *, lookahead: int = 16, top_logprobs: int = 20,
                 parallel: int = 1, context_limit: int | None = None):
        if lookahead < 1 or top_logprobs < 1 or parallel < 1:
            raise ValueError("lookahead, top_logprobs and parallel must be at least 1")
        self.server, self.vocab_size = server, vocab_size
        self.lookahead, self.top_logprobs = lookahead, top_logprobs
        self.pool = ThreadPoolExecutor(parallel) if parallel > 1 else None
        self._limit = context_limit or server.context_limit() or 1 << 30
        self.rows: list[RemoteRow] = []
        self.calls = 0

    @property
    def context_limit(self) -> int:
        return self._limit

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def _new_row(self) -> RemoteRow:
        return RemoteRow()

    def reset(self, batch_size: int = 0) -> None:
        self.rows = [self._new_row() for _ in range(batch_size)]

    def add_rows(self, prompts: list[list[int]], share_prefix: bool = True) -> list[list[int]]:
        """New rows start empty and feed their whole prompt (the server's cache holds any prefix)."""
        self.rows += [self._new_row() for _ in prompts]
        return [list(p) for p in prompts]

    def select(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def compact(self, force: bool = False) -> None:
        pass

    def row_info(self, i: int) -> dict | None:
        info, self.rows[i].info = self.rows[i].info, None
        return info

    def step(self, feeds: list[list[int]]) -> torch.Tensor:
        """Append each row's tokens; log-probability rows for what comes next (zeros for rows that
        fed nothing). Rows whose lookahead no longer matches go to the server, together."""
        assert len(feeds) == len(self.rows), "rows must match the batch"
        if not any(feeds):
            raise ValueError("no row has anything to feed")
        ask = []
        for i, (row, feed) in enumerate(zip(self.rows, feeds)):
            if not feed:
                continue
            if row.ahead and len(feed) == 1 and feed[0] == row.ahead[0].token:
                row.ahead.popleft()
            else:
                row.ahead.clear()
            row.tokens += feed
            if not row.ahead:
                ask.append(i)
        if ask:
            self._ask(ask)
        logits = torch.zeros(len(self.rows), self.vocab_size)
        for i, (row, feed) in enumerate(zip(self.rows, feeds)):
            if feed:
                logits[i] = self._scores(row.ahead[0].top)
        return logits

    def _ask(self, ask: list[int]) -> None:
        """Ask the server what comes next for these rows (their lookahead is used up)."""
        calls = [self.rows[i].tokens for i in ask]
        done = list(self.pool.map(self._complete, calls)) if self.pool else [self._complete(t) for t in calls]
        self._take(ask, done)

    def _take(self, ask: list[int], done: list[tuple[Completion, dict]]) -> None:
        for i, (completion, info) in zip(ask, done):
            self.rows[i].ahead = deque(completion.predictions)
            self.rows[i].info = info

    def _predict_n(self, tokens: list[int]) -> int:
        return max(1, min(self.lookahead, self._limit - len(tokens)))

    def _complete(self, tokens: list[int]) -> tuple[Completion, dict]:
        completion = self.server.complete(list(tokens), self._predict_n(tokens), self.top_logprobs)
        return completion, self._accept(tokens, completion)

    def _accept(self, tokens: list[int], completion: Completion) -> dict:
        """Count the call, check it, and say what the server did with the prompt."""
        self.calls += 1
        if not completion.predictions:
            raise RemoteError("the server returned no tokens (context full on the server side?)")
        info = {"cache_n": completion.cache_n, "prompt_n": completion.prompt_n}
        if completion.prompt_ms is not None:
            info["prompt_ms"] = completion.prompt_ms
        if completion.prompt_ids is not None and list(completion.prompt_ids) != list(tokens):
            info["retokenized"] = True
        return info

    def _scores(self, top: list[tuple[int, float]]) -> torch.Tensor:
        """Top log-probabilities in place, every other token 30 nats below the least of them
        (finite, so a single allowed token still reads as forced)."""
        ids = torch.tensor([t for t, _ in top], dtype=torch.long)
        vals = torch.tensor([v for _, v in top], dtype=torch.float32)
        if int(ids.max()) >= self.vocab_size:
            raise RemoteError(f"the server returned token id {int(ids.max())}; the local tokenizer has "
                              f"{self.vocab_size} tokens: is it serving the same model?")
        row = torch.full((self.vocab_size,), float(vals.min()) - 30.0)
        row[ids] = vals
        return row

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        self.server.close()
