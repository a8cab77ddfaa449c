"""Index build at scale: N generated documents through `rig index build`, then `rig ask` over them.

Writes N Markdown files with front matter (support tickets: ids, error codes, versions, statuses)
to a temporary folder, builds an index with the CLI (progress bar on stderr), updates it with a
few changed documents, and asks one question whose answer is in a single ticket.

    python bench/ingest.py [--docs 10000] [--keep DIR]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import emit, fields  # bench/ is on sys.path when run as a script

PRODUCTS = ["Helios Gateway", "Nimbus Queue", "Atlas Store", "Vega Cache", "Orion Mesh"]
SYMPTOMS = ["timeouts under load", "a crash on startup", "stale reads after failover", "memory growth",
            "TLS handshake failures", "duplicate deliveries", "slow queries", "lost metrics"]
FILLER = ("The customer attached logs and a configuration dump. Support reproduced the issue in a lab "
          "environment and escalated it to engineering. A workaround was shared while the fix was prepared. ")


def write_docs(folder: Path, n: int, seed: int = 0) -> tuple[str, str]:
    rng = random.Random(seed)
    probe = (0, "", "")
    for i in range(n):
        product = rng.choice(PRODUCTS)
        code = f"E{rng.randint(1000, 9999)}"
        version = f"{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"
        text = (f"# Ticket T-{i:05d}\n\nCustomer report for {product}: error {code} with {rng.choice(SYMPTOMS)}. "
                + FILLER * rng.randint(1, 6) + f"Resolved in {product} version {version}.\n")
        status = rng.choice(["open", "resolved", "resolved", "closed"])
        (folder / f"t{i:05d}.md").write_text(f"---\nid: T-{i:05d}\nstatus: {status}\nproduct: {product}\n---\n{text}")
        if i == n // 2:
            probe = (i, f"In which version of {product} was ticket T-{i:05d} (error {code}) resolved?", version)
    return probe


def rig(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rig_decode.cli", *args], capture_output=True, text=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=10_000)
    ap.add_argument("--keep", help="write the documents and index here instead of a temporary folder")
    args = ap.parse_args(argv)
    root = Path(args.keep or tempfile.mkdtemp(prefix="rig-ingest-"))
    src, index = root / "docs", root / "index"
    src.mkdir(parents=True, exist_ok=True)
    _, question, version = write_docs(src, args.docs)

    t0 = time.perf_counter()
    build = subprocess.run([sys.executable, "-m", "rig_decode.cli", "index", "build", "--input", str(src),
                            "--out", str(index), "--replace"], stdout=subprocess.PIPE, text=True)
    if build.returncode:
        print("index build failed", file=sys.stderr)
        return 1
    report = json.loads(build.stdout.strip().splitlines()[-1])
    build_s = time.perf_counter() - t0

    for i in range(5):  # an incremental update: five documents change
        p = src / f"t{i:05d}.md"
        p.write_text(p.read_text().replace("Resolved in", "Patched and resolved in"))
    update = json.loads(rig("index", "build", "--input", str(src), "--out", str(index)).stdout.strip().splitlines()[-1])

    target = question.split("ticket ")[1].split(" ")[0]
    from rig_decode.config import RetrieverConfig
    from rig_decode.retrieval.factory import build_retriever

    t0 = time.perf_counter()
    retriever = build_retriever(RetrieverConfig(index_path=str(index)))
    load_s = time.perf_counter() - t0
    direct = [h.doc_id for h in retriever.search_batch([question], 5)[0]]

    cfg = root / "rig.yaml"
    cfg.write_text(f"retriever: {{index_path: {json.dumps(str(index))}, top_k: 3}}\nmodel: {{max_tokens: 48}}\n"
                   "rig: {retrieve_first: true}\n")
    t0 = time.perf_counter()
    ask = rig("ask", question, "--config", str(cfg), "--json")
    ask_s = time.perf_counter() - t0
    answer = json.loads(ask.stdout.strip().splitlines()[-1]) if ask.returncode == 0 else {}
    hops = answer.get("trace", {}).get("retrieval_steps", [])
    found = any(d["id"] == target for h in hops for d in h["docs"])

    rows = [("documents", report["documents"]), ("chunks", report["chunks"]),
            ("build seconds (wall, incl. model load)", round(build_s, 1)), ("embedding + write seconds", report["seconds"]),
            ("peak RSS MB", report["peak_rss_mb"]), ("update: chunks re-embedded", update["embedded_chunks"]),
            ("update: embeddings reused", update["reused_embeddings"]), ("update seconds", update["seconds"]),
            ("index load seconds", round(load_s, 1)),
            ("question as query: target rank", direct.index(target) + 1 if target in direct else None),
            ("rig ask seconds (incl. load)", round(ask_s, 1)), ("rig ask hops", len(hops)),
            ("rig ask queries", [h["query"] for h in hops]),
            ("target ticket in the model's hops", found)]
    fields(dict(rows))
    emit({"bench": "ingest", **{k.split(" (")[0].replace(" ", "_").replace(":", ""): v for k, v in rows},
          "ask_rc": ask.returncode, "question": question, "expected": version, "answer": answer.get("answer")})
    return 0 if ask.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
