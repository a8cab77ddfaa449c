"""A llama-server stand-in over a local HF model: the native ``/completion`` endpoint with token-id
prompts, greedy lookahead, ``n_probs`` top log-probabilities (none at 0), ``logit_bias`` bans
(``[[id, false], ...]``) and a one-slot prompt cache whose use it reports in ``timings`` the way llama.cpp does (``cache_n`` reused, ``prompt_n`` evaluated).
Like ``llama-server -np N``, it has N slots and serves a request from the slot ``id_slot`` names, or
else from the one whose cached tokens share the longest prefix with the prompt (the least recently
used one when none does). ``stream: true`` sends one Server-Sent Event per token (with ``timings``
on each, as ``timings_per_token`` asks) and stops decoding when the client closes the connection."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class FakeLlamaServer:
    def __init__(self, model, eos_id: int, n_ctx: int = 2048, slots: int = 4, drop_connections: int = 0,
                 slot_actions: bool = True, garbage: int = 0, token_delay_s: float = 0.0, bad_ids: int = 0,
                 token_text=None, honour_bans: bool = True, drop_slot: int | None = None,
                 slow_slots: dict[int, float] | None = None):
        self.model, self.eos_id, self.n_ctx = model, eos_id, n_ctx
        self.drop_connections, self.drop_slot = drop_connections, drop_slot
        """The first this many completion requests (for slot ``drop_slot``: None, any) are dropped:
        the connection is closed unanswered."""
        self.garbage, self.token_delay_s = garbage, token_delay_s
        """``token_delay_s``: a pause after each decoded token (a server slower than its client)."""
        """The first this many completion requests are answered with something that is not JSON."""
        self.bad_ids = bad_ids
        """The first this many streamed completions name a negative token id among their top ones."""
        self.token_text = token_text
        """id -> text: a request's ``stop`` texts end its completion (without it they are ignored)."""
        self.honour_bans = honour_bans
        self.slow_slots = slow_slots or {}
        """slot -> seconds every request on it waits before its first token (a long prefill)."""
        """False: ``logit_bias`` is taken and ignored (a bias too weak to ban)."""
        self.slot_actions = slot_actions
        """Whether ``POST /slots/N?action=erase`` works (llama-server started with ``--slot-save-path``)."""
        self.slots: list[list[int]] = [[] for _ in range(slots)]  # each: last prompt + what it generated
        self.used = [0] * slots  # when each slot last served (for least recently used)
        self.requests: list[dict] = []
        self.decoded = 0
        self.overruled = 0
        """Tokens a ``logit_bias`` ban kept the server from picking."""
        """Tokens decoded over all requests (a closed stream stops adding to it)."""
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def complete(self, body: dict) -> dict:
        tokens, probs, timings = [], [], None
        for tok, prob, timings in self.generate(body):
            tokens.append(tok)
            probs.append(prob)
        return {"tokens": tokens, "completion_probabilities": probs, "timings": timings}

    def generate(self, body: dict):
        """``(token, its probabilities, timings)`` per decoded token; the slot's cache follows."""
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ValueError("this stand-in takes token-id prompts only")
        if any(bias is not False for _, bias in body.get("logit_bias", [])):
            raise ValueError("this stand-in takes logit_bias bans ([id, false]) only")
        banned = sorted(int(t) for t, _ in body.get("logit_bias", [])) if self.honour_bans else []
        with self.lock:
            lcps = [_common_prefix(slot, prompt) for slot in self.slots]
            if body.get("id_slot") is not None:
                best = body["id_slot"] % len(self.slots)
            else:
                best = max(range(len(self.slots)), key=lambda i: (lcps[i], -self.used[i]))
                if lcps[best] == 0:
                    best = min(range(len(self.slots)), key=lambda i: self.used[i])
            self.used[best] = max(self.used) + 1
            cache_n = min(lcps[best], len(prompt) - 1)  # a fully cached prompt re-evaluates its last token
            self.requests.append({"at": time.perf_counter(), "prompt_len": len(prompt),
                                  "n_predict": body.get("n_predict"), "slot": best,
                                  "stream": bool(body.get("stream")), "stop": body.get("stop"),
                                  "n_probs": body.get("n_probs", 0), "banned": banned})
            self.slots[best] = ids = list(prompt)
        timings = {"cache_n": cache_n, "prompt_n": len(prompt) - cache_n}
        time.sleep(self.slow_slots.get(best, 0.0))
        text = ""
        for _ in range(min(body.get("n_predict", 16), self.n_ctx - len(prompt))):
            with self.lock, torch.no_grad():
                logp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
                self.overruled += int(int(logp.argmax()) in banned)
                logp[banned] = float("-inf")
                top = torch.topk(logp, body.get("n_probs", 0) or 1)
                tok = int(top.indices[0])
                ids.append(tok)
                self.decoded += 1
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            yield tok, {"id": tok, "logprob": float(top.values[0]),
                        "top_logprobs": [{"id": int(i), "logprob": float(v)} for i, v in zip(top.indices, top.values)]
                        }, timings
            text = text + self.token_text(tok) if self.token_text else ""
            if tok == self.eos_id or any(text.endswith(stop) for stop in body.get("stop") or []):
                break

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/props":
                    self._send(200, {"default_generation_settings": {"n_ctx": server.n_ctx},
                                     "total_slots": len(server.slots)})
                elif self.path == "/slots":
                    with server.lock:
                        self._send(200, [{"id": i, "n_ctx": server.n_ctx, "n_tokens": len(slot)}
                                         for i, slot in enumerate(server.slots)])
                else:
                    self._send(404, {"error": "not found"})

            def _erase(self, slot: str):
                if not server.slot_actions:
                    self._send(501, {"error": {"code": 501, "message": "This server does not support slots action. "
                                                                      "Start it with `--slot-save-path`"}})
                    return
                with server.lock:
                    n, server.slots[int(slot)] = len(server.slots[int(slot)]), []
                self._send(200, {"id_slot": int(slot), "n_erased": n})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                erase = re.fullmatch(r"/slots/(\d+)\?action=erase", self.path)
                if erase:
                    self._erase(erase.group(1))
                    return
                if self.path != "/completion":
                    self._send(404, {"error": "not found"})
                    return
                with server.lock:
                    drop = server.drop_connections > 0 and server.drop_slot in (None, body.get("id_slot"))
                    server.drop_connections -= drop
                if drop:
                    self.close_connection = True
                    return
                with server.lock:
                    garbage, server.garbage = server.garbage > 0, max(0, server.garbage - 1)
                if garbage:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream" if body.get("stream") else "text/plain")
                    self.end_headers()
                    self.wfile.write(b"data: {not json\n\n" if body.get("stream") else b"<html>oops</html>")
                    self.close_connection = True
                    return
                try:
                    if body.get("stream"):
                        self._stream(body)
                    else:
                        self._send(200, server.complete(body))
                except ValueError as e:
                    self._send(400, {"error": str(e)})

            def _stream(self, body: dict):
                events = server.generate(body)
                first = next(events, None)  # a bad request fails before the stream starts
                with server.lock:
                    bad, server.bad_ids = server.bad_ids > 0 and first is not None, max(0, server.bad_ids - 1)
                if bad and body.get("n_probs", 0):
                    first[1]["top_logprobs"][-1]["id"] = -5
                elif bad:
                    first = (-5, *first[1:])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.close_connection = True
                try:
                    for tok, prob, timings in _chain([first] if first else [], events):
                        event = {"tokens": [tok], "timings": timings, "stop": tok == server.eos_id}
                        if body.get("n_probs", 0):  # llama-server sends none at n_probs 0
                            event["completion_probabilities"] = [prob]
                        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    events.close()  # the client went away: stop decoding

        return Handler


def _chain(first: list, rest):
    yield from first
    yield from rest


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
