"""The completion servers the remote runners talk to, over HTTP: llama.cpp's ``llama-server``
(native ``/completion``) and an OpenAI-compatible ``/v1/completions`` (vLLM's server). Token ids go
up as the prompt and come back with each position's top log-probabilities, as one response
(``complete``) or as a stream of Server-Sent Events (``stream_completion``); every failure is a
``RemoteError`` that names the server."""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import dataclass


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

    def _send(self, path: str, body: dict, stream: bool = False):
        """``POST`` ``body``; the response (read, or open where ``stream``). A request that got no
        answer at all on a kept-alive connection goes once more, on a new one: the server had closed
        that connection (llama-server does after a stream read to its end, racing the client's next
        request on it), so it never saw the request."""
        import httpx

        request = self.http.build_request("POST", path, json=body)
        try:
            return self.http.send(request, stream=stream)
        except httpx.RemoteProtocolError:  # "Server disconnected without sending a response"
            return self.http.send(request, stream=stream)

    def post(self, path: str, body: dict) -> dict:
        import httpx

        try:
            r = self._send(path, body)
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

        if cancelled():  # closed before it went
            return
        try:
            with closing(self._send(path, body, stream=True)) as r:
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
                          stop: tuple[str, ...] = (), banned: list[int] = (), cancelled=lambda: False, opened=None):
        """The completion as it decodes: ``(predictions, info)`` per event (``info``: the prompt's
        accounting, on the events that carry timings); ``slot`` pins the request to a slot; the
        server stops after a token that completes a ``stop`` text (it streams that token) and never
        picks a ``banned`` id. ``n_probs`` 0: each prediction is its token alone (llama-server then
        skips sorting the vocabulary)."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "n_probs": n_probs, "temperature": 0.0,
                "cache_prompt": True, "return_tokens": True, "repeat_penalty": 1.0, "stream": True,
                "timings_per_token": True, "stop": list(stop)}
        if banned:
            body["logit_bias"] = [[int(t), False] for t in banned]
        if slot is not None or self.slot is not None:
            body["id_slot"] = self.slot if slot is None else slot
        for event in self.stream("/completion", body, cancelled, opened):
            tokens, probs = event.get("tokens") or [], event.get("completion_probabilities") or []
            if n_probs == 0:
                probs = [{}] * len(tokens)
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
                          stop: tuple[str, ...] = (), banned: list[int] = (), cancelled=lambda: False, opened=None):
        """The completion as it decodes (see ``LlamaCppServer.stream_completion``; a ban is a logit
        bias of -100, the API's least); the prompt's accounting comes from vLLM's per-chunk usage
        (``continuous_usage_stats``)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": n_predict, "temperature": 0.0,
                "logprobs": n_probs or None, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False, "stream": True, "stop": list(stop), "include_stop_str_in_output": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if banned:
            body["logit_bias"] = {str(int(t)): -100 for t in banned}
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
