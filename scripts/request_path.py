"""Follow one request from the HTTP handler to the KV write and back, and count what it touches.

A chat completion goes through the server's app in process (FastAPI's ``TestClient``) with a
profile hook on every thread. Each call into ``rig_decode`` is recorded: the files it enters, the
threads it runs on, and every call site that crosses files (the nearest ``rig_decode`` frame below
it -> the function called). A call goes **up** a layer when the called module imports the caller's
module, directly or through others (``scripts/layout.py``): that is a callback, the engine
reaching back into what drives it. Module bodies run by lazy imports are not calls.

    python scripts/request_path.py                      # the embedded default and its demo
    python scripts/request_path.py --config my.yaml --question "..."

It prints a table, then one JSON line last. ``PYTHONPATH=<another checkout>`` measures that
checkout's package instead (the import graph is read from the package that is imported).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout import import_graph, importers  # noqa: E402

KV_WRITE = ("rig_decode.models.kv_buffers", "update")


@dataclass
class RequestPath:
    files: dict[str, int] = field(default_factory=dict)
    """Module -> its lines, for every module the request entered."""
    threads: set[str] = field(default_factory=set)
    calls: Counter = field(default_factory=Counter)
    """(caller module, called module, function) -> times called."""
    up: list[tuple[str, str, str]] = field(default_factory=list)
    """The call sites of ``calls`` that go up a layer."""

    @property
    def reaches_kv_write(self) -> bool:
        return any((callee, fn) == KV_WRITE for _, callee, fn in self.calls)

    def summary(self) -> dict:
        return {"files": len(self.files), "lines": sum(self.files.values()), "threads": len(self.threads),
                "cross_file_call_sites": len(self.calls), "up_call_sites": len(self.up),
                "up": [f"{a} -> {b}.{fn}" for a, b, fn in self.up], "reaches_kv_write": self.reaches_kv_write}


def trace_calls(setup, run, package_dir: Path) -> RequestPath:
    """``run(setup())`` with every thread profiled (threads ``setup`` starts included); what ``run``
    did inside the package at ``package_dir``."""
    root = str(package_dir.parent) + "/"
    names: dict[str, str | None] = {}

    def module_of(filename: str) -> str | None:
        if filename not in names:
            inside = filename.startswith(str(package_dir) + "/") and filename.endswith(".py")
            name = filename[len(root):-3].replace("/", ".").removesuffix(".__init__") if inside else None
            names[filename] = name
        return names[filename]

    path, lock, active = RequestPath(), threading.Lock(), threading.Event()

    def hook(frame, event, arg):
        if event != "call" or not active.is_set():
            return
        callee = module_of(frame.f_code.co_filename)
        if callee is None or frame.f_code.co_name == "<module>":
            return
        caller_frame = frame.f_back
        while caller_frame is not None and module_of(caller_frame.f_code.co_filename) is None:
            caller_frame = caller_frame.f_back
        with lock:
            if callee not in path.files:
                path.files[callee] = len(Path(frame.f_code.co_filename).read_text(encoding="utf-8").splitlines())
            path.threads.add(threading.current_thread().name)
            if caller_frame is not None:
                caller = module_of(caller_frame.f_code.co_filename)
                if caller != callee:
                    path.calls[(caller, callee, frame.f_code.co_name)] += 1

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        state = setup()
        active.set()
        run(state)
    finally:
        active.clear()
        sys.setprofile(None)
        threading.setprofile(None)
    above = importers(import_graph(package_dir))
    path.up = sorted(site for site in path.calls if site[1] in above.get(site[0], set()))
    return path


def chat_once(client, question: str, stream: bool = False) -> dict:
    """One chat completion through ``client`` (a ``TestClient`` of the app); its JSON (the last
    chunk's, streamed)."""
    body = {"model": client.app.state.rig.model_id, "messages": [{"role": "user", "content": question}],
            "stream": stream}
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    if not stream:
        return response.json()
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return chunks[-1]


def trace_request(make_app, question: str, stream: bool = False) -> tuple[RequestPath, dict]:
    """One chat completion against the app ``make_app()`` builds (its engine thread starts under the
    profile hook, and only the request is recorded); what it touched, and its response."""
    from fastapi.testclient import TestClient

    import rig_decode

    out, clients = {}, []

    def setup():
        client = TestClient(make_app())
        clients.append(client)
        client.__enter__()  # startup, outside the request
        return client

    try:
        path = trace_calls(setup, lambda client: out.update(chat_once(client, question, stream)),
                           Path(rig_decode.__file__).resolve().parent)
    finally:
        for client in clients:
            client.__exit__(None, None, None)
    return path, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="YAML config (default: the embedded default and its demo knowledge base)")
    ap.add_argument("--question", default="Who founded the company that makes the Brisa T4?")
    ap.add_argument("--stream", action="store_true", help="stream the answer (Server-Sent Events)")
    args = ap.parse_args(argv)

    from rig_decode.config import RigConfig
    from rig_decode.server.app import create_app
    from rig_decode.session import RigSession

    config = RigConfig.from_yaml(args.config) if args.config else RigConfig()
    engine = RigSession(config).engine  # loaded before tracing: the request is what is measured
    path, out = trace_request(lambda: create_app(config, engine=engine), args.question, args.stream)
    hops = out.get("rig", {}).get("num_hops", 0)
    s = path.summary()
    print(f"one request ({hops} hops) from the HTTP handler to the KV write and back")
    print(f"  files entered      {s['files']:>6}   ({s['lines']} lines)")
    print(f"  threads            {s['threads']:>6}   ({', '.join(sorted(path.threads))})")
    print(f"  cross-file calls   {s['cross_file_call_sites']:>6}   call sites (caller module -> function)")
    print(f"  calls up a layer   {s['up_call_sites']:>6}")
    for site in s["up"]:
        print(f"      {site}")
    print(f"  reaches the KV write ({'.'.join(KV_WRITE)}): {s['reaches_kv_write']}")
    print(json.dumps({"hops": hops, **s, "files_entered": sorted(path.files)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
