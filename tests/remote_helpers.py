"""A llama-server stand-in over a local HF model: the native ``/completion`` endpoint with token-id
prompts, greedy lookahead, ``n_probs`` top log-probabilities and a one-slot prompt cache whose use
it reports in ``timings`` the way llama.cpp does (``cache_n`` reused, ``prompt_n`` evaluated).
Like ``llama-server -np N``, it has N slots and serves a request from the slot whose cached tokens
share the longest prefix with the prompt (the least recently used one when none does)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class FakeLlamaServer:
    def __init__(self, model, eos_id: int, n_ctx: int = 2048, slots: int = 4, drop_connections: int = 0,
                 slot_actions: bool = True):
        self.model, self.eos_id, self.n_ctx = model, eos_id, n_ctx
        self.drop_connections = drop_connections
        """The first this many completion requests are dropped: the connection is closed unanswered."""
        self.slot_actions = slot_actions
        """Whether ``POST /slots/N?action=erase`` works (llama-server started with ``--slot-save-path``)."""
        self.slots: list[list[int]] = [[] for _ in range(slots)]  # each: last prompt + what it generated
        self.requests: list[dict] = []
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
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ValueError("this stand-in takes token-id prompts only")
        with self.lock:
            lcps = [_common_prefix(slot, prompt) for slot in self.slots]
            best = max(range(len(self.slots)), key=lambda i: lcps[i])
            if lcps[best] == 0:
                best = 0
            lcp = lcps[best]
            self.slots.append(self.slots.pop(best))  # most recently used last; slot 0 is the oldest
            cache_n = min(lcp, len(prompt) - 1)  # a fully cached prompt re-evaluates its last token
            ids, tokens, probs = list(prompt), [], []
            with torch.no_grad():
                for _ in range(body.get("n_predict", 16)):
                    logp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
                    top = torch.topk(logp, body.get("n_probs", 0) or 1)
                    tok = int(top.indices[0])
                    tokens.append(tok)
                    probs.append({"id": tok, "logprob": float(top.values[0]),
                                  "top_logprobs": [{"id": int(i), "logprob": float(v)}
                                                   for i, v in zip(top.indices, top.values)]})
                    ids.append(tok)
                    if tok == self.eos_id:
                        break
            self.slots[-1] = ids
            self.requests.append({"prompt_len": len(prompt), "n_predict": body.get("n_predict")})
            return {"tokens": tokens, "completion_probabilities": probs,
                    "timings": {"cache_n": cache_n, "prompt_n": len(prompt) - cache_n}}

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
                    self._send(200, {"default_generation_settings": {"n_ctx": server.n_ctx}})
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
                    drop, server.drop_connections = server.drop_connections > 0, max(0, server.drop_connections - 1)
                if drop:
                    self.close_connection = True
                    return
                try:
                    self._send(200, server.complete(body))
                except ValueError as e:
                    self._send(400, {"error": str(e)})

        return Handler


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
