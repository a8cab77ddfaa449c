"""Convert public multi-hop *train* questions (HotpotQA, MuSiQue-Ans) into a folder of ``rig synth``'s shape.

    python scripts/convert_multihop.py --source /path/to/HippoRAG/git-dir --out out/multihop
    python scripts/make_marker_data.py --synth out/multihop --out out/md-multihop --variants special --splits train

Reads ``data/hotpotqa_train.json`` (HotpotQA train, distractor setting, CC BY-SA 4.0) and
``data/musique_train.json`` (MuSiQue-Ans train, CC BY 4.0), 100 records each, from
OSU-NLP-Group/HippoRAG at ``COMMIT`` (later commits dropped them): ``--source`` is a git directory
of that repository (read with ``git show``) or a folder holding the two files. No dev set is read.

Writes ``train.jsonl`` (questions with their hop ``plan``, as ``eval/world_questions.py`` writes
them), ``corpus.jsonl`` (every paragraph once, its title as its id) and ``SOURCE.json`` (repository,
commit, path, license, record counts, sha256 of each raw file). A hop's queries use only what a
model knows at that point, the question and earlier hops' answers: HotpotQA bridge questions search
the question, then the bridge entity (a supporting paragraph's title the other's text names) with
the question's relation words; comparisons search each entity with the compared attribute; MuSiQue
searches its sub-questions (``#1`` replaced by hop 1's answer), as written and as keywords.

Dropped (counted): answers the last hop's paragraph does not hold (comparisons: neither yes/no nor a
compared entity), bridges no text names, and gold paragraphs whose title another text holds (a
title keeps its first text, gold paragraphs before distractors).
"""
from __future__ import annotations

import argparse
import hashlib
import html
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = "OSU-NLP-Group/HippoRAG"
COMMIT = "3d95d255a8db0c1699b853cfb4fbe5056708162d"
DATASETS = {"hotpotqa": ("data/hotpotqa_train.json", "CC BY-SA 4.0"),
            "musique": ("data/musique_train.json", "CC BY 4.0")}
MAX_QUERY_WORDS = 24  # the decoder cuts a query at max_query_tokens (48)
STOP = set("""a an the of in on at to for from by with and or as is are was were be been being do does did
has have had it its this that these those which what who whom whose when where why how many much there
than then into onto both also either any some same other another his her their he she they him them
while during after before about over under between not only most more name known""".split())
RELATIONS = {"located in the administrative territorial entity": "located in", "educated at": "education",
             "located in or next to body of water": "located next to body of water", "member of sports team":
             "sports team", "member of political party": "political party", "licensed to broadcast to": "licensed to"}
"""Wikidata property labels of MuSiQue's ``X >> relation`` sub-questions, as a searcher words them."""
WH = re.compile(r"\b(?:(?:in|at|on|from|for|to|of|by|during|with) )?(?:what|which|who|whom|whose|when|where|"
                r"how (?:many|much|long|old)|how)\b", re.I)


def clean(text: str) -> str:
    text = " ".join(html.unescape(text).split())
    return re.sub(r" ([?,.!)]|'s\b)", r"\1", text)


def base(title: str) -> str:
    """A title without its disambiguation: "Lilu (mythology)" -> "Lilu"."""
    return re.sub(r"\s*\([^)]*\)$", "", title).strip() or title


def has(text: str, part: str) -> bool:
    return part.lower() in text.lower()


def words(text: str) -> list[str]:
    return re.findall(r"\w[\w'’&.-]*\w|\w", text)


def fold(word: str) -> str:
    return re.sub(r"['’]s$", "", word.lower())


def keywords(text: str, drop: str = "") -> list[str]:
    """The content words of ``text`` in order, without those of ``drop``."""
    gone = STOP | {fold(w) for w in words(drop)}
    return [w for w in words(text) if fold(w) not in gone]


def statement(question: str) -> str:
    """The question as a search: its first wh-phrase and the question mark removed."""
    text = WH.sub("", question.rstrip(" ?"), count=1).strip(" ,")
    return clean(re.sub(r"^(?:(?:of|is|are|was|were|did|does|do|has|have|had)\s+)+", "", text, flags=re.I))


def near(question: str, drop: str, n: int, anchor: str = "") -> list[str]:
    """The ``n`` content words nearest ``anchor`` (default: the wh-word, i.e. the asked relation), in
    question order, without those of ``drop``."""
    toks = words(question)
    m = re.search(re.escape(anchor), question, re.I) if anchor else WH.search(question)
    at = len(words(question[:m.start()])) if m else 0
    gone = STOP | {fold(w) for w in words(f"{drop} {anchor}")}
    close = sorted((abs(i - at), i) for i, w in enumerate(toks) if fold(w) not in gone)[:n]
    return [toks[i] for i in sorted(i for _, i in close)]


def queries(*phrasings: str) -> list[str]:
    out = []
    for q in map(clean, phrasings):
        if q and q.lower() not in {x.lower() for x in out} and len(q.split()) <= MAX_QUERY_WORDS:
            out.append(q)
    return out[:3]


def record(rid: str, question: str, answer: str, kind: str, template: str, plan: list[dict]) -> dict:
    docs = list(dict.fromkeys(p["doc"] for p in plan))
    return {"id": rid, "question": clean(question), "answer": clean(answer), "hops": len(plan), "supporting_docs": docs,
            "needs_retrieval": True, "kind": kind, "template": template, "split": "train",
            "entities": list(dict.fromkeys(p["entity"] for p in plan)), "plan": plan}


def named(text: str) -> str:
    """The longest run of capitalised words in ``text`` (past its first word), else its first keywords:
    what a first hop is about when no title is named."""
    runs = re.findall(r"(?<=\s)[A-Z0-9][\w'’.-]*(?:,? (?:(?:of|the|and|de|von|in|on) )*[A-Z0-9][\w'’.-]*)*", text)
    return max(runs, key=len) if runs else " ".join(keywords(text)[:3])


def hop(entity: str, doc: str, *phrasings: str) -> dict:
    return {"entity": entity, "doc": doc, "queries": queries(*phrasings)}


def paragraphs(rec: dict) -> list[tuple[str, str]]:
    """(title, text) of every paragraph a record comes with, HotpotQA's or MuSiQue's."""
    if "context" in rec:
        return [(clean(t), clean(" ".join(s.strip() for s in sents))) for t, sents in rec["context"]]
    return [(clean(p["title"]), clean(p["paragraph_text"])) for p in rec["paragraphs"]]


def hotpotqa(rec: dict) -> tuple[dict | None, str, list[tuple[str, str]]]:
    """(record or None, why dropped, (title, text) of its gold paragraphs)."""
    ctx = dict(paragraphs(rec))
    gold = list(dict.fromkeys(clean(t) for t, _ in rec["supporting_facts"]))
    q, answer, rid = clean(rec["question"]), clean(rec["answer"]), f"hotpotqa-{rec['_id']}"
    if len(gold) != 2 or any(t not in ctx for t in gold):
        return None, "hotpotqa: not two supporting paragraphs in the context", []
    paras = {t: ctx[t] for t in gold}
    if rec["type"] == "comparison":
        if any(not has(q, base(t)) for t in gold):
            return None, "hotpotqa comparison: an entity the question does not name", [*paras.items()]
        gold.sort(key=lambda t: q.lower().index(base(t).lower()))
        names = [base(t) for t in gold]
        said = {w.lower() for w in words(answer)}  # "Nicholas Lofton "Nick" Hexum" names Nick Hexum
        if answer.lower() not in ("yes", "no") and not any({w.lower() for w in words(n)} <= said for n in names):
            return None, "hotpotqa comparison: answer neither yes/no nor a compared entity", [*paras.items()]
        attr = keywords(q, " ".join(names))[:4]
        plan = [hop(n, t, f"{n} {' '.join(attr)}", f"{n} {' '.join(attr[:2])}", n) for n, t in zip(names, gold)]
        return record(rid, q, answer, "compare", "hotpotqa:comparison", plan), "", [*paras.items()]
    best = None  # (rank, first, second, bridge): the order whose last paragraph holds the answer
    for first, second in (gold, gold[::-1]):
        if not has(paras[second], answer):
            continue
        a, b = base(first), base(second)
        for rank, ok, bridge in ((0, has(paras[first], b), b), (1, has(q, b), b),
                                 (2, has(paras[second], a) and not has(q, a), a)):
            if ok and (best is None or rank < best[0]):
                best = (rank, first, second, bridge)
    if best is None:
        why = "no bridge entity named" if any(has(p, answer) for p in paras.values()) else "answer not in its paragraph"
        return None, f"hotpotqa bridge: {why}", [*paras.items()]
    _, first, second, bridge = best
    lead = base(first) if has(q, base(first)) else ""
    hop1 = hop(lead or named(q), first, statement(q), " ".join(keywords(q)[:10]),
               f"{lead} {' '.join(near(q, '', 4, lead))}" if lead else "")
    hop2 = hop(bridge, second, *(f"{bridge} {' '.join(near(q, f'{lead} {bridge}', n))}" for n in (2, 4)),
               f"{bridge} {' '.join(keywords(q, f'{lead} {bridge}')[:8])}")
    return record(rid, q, answer, "chain", "hotpotqa:bridge", [hop1, hop2]), "", [*paras.items()]


def musique(rec: dict) -> tuple[dict | None, str, list[tuple[str, str]]]:
    paras = paragraphs(rec)
    q, answer, rid = clean(rec["question"]), clean(rec["answer"]), f"musique-{rec['id']}"
    answers, plan, gold = [], [], []
    for step in rec["question_decomposition"]:
        refs = [answers[int(k) - 1] for k in re.findall(r"#(\d+)", step["question"])]
        sub = clean(re.sub(r"#(\d+)", lambda m: answers[int(m.group(1)) - 1], step["question"]))
        sub = re.sub(r"\b(the|in) \1\b", r"\1", sub, flags=re.I)  # "in #1" with #1 = "in London"
        title, text = paras[step["paragraph_support_idx"]]
        gold.append((title, text))
        known = " ".join([q, *answers])  # what the model can have read by now
        if ">>" in sub:
            subject, rel = (s.strip() for s in sub.split(">>", 1))
            rel = RELATIONS.get(rel, rel)
            ends_open = rel.rsplit(" ", 1)[-1] in ("of", "in", "to", "with")  # "part of", "located in"
            phrasings = ([f"{subject} {rel}", f"what is {subject} {rel}"] if ends_open
                         else [f"{rel} of {subject}", f"{subject} {rel}"])
            entity = refs[0] if refs else subject
        else:
            subject, rel = sub, " ".join(keywords(sub, base(title))[:4])
            phrasings = [sub.rstrip("?"), " ".join(keywords(sub))]
            entity = refs[0] if refs else base(title) if has(known, base(title)) else named(sub)
        if has(known, base(title)) and not has(subject, base(title)):
            phrasings.append(f"{base(title)} {rel}")
        plan.append(hop(entity, title, *phrasings))
        answers.append(re.sub(r"^in ", "", clean(step["answer"])))  # "in London": the place is London
    if not has(gold[-1][1], answer):
        return None, "musique: answer not in its paragraph", gold
    template = "musique:" + rec["id"].split("__")[0]
    return record(rid, q, answer, "chain", template, plan), "", gold


def read_raw(source: Path, path: str) -> bytes:
    for f in (source / path, source / Path(path).name):
        if f.is_file():
            return f.read_bytes()
    git = source / ".git" if (source / ".git").exists() else source
    proc = subprocess.run(["git", f"--git-dir={git}", "show", f"{COMMIT}:{path}"], capture_output=True)
    if proc.returncode:
        sys.exit(f"{source}: neither {Path(path).name} nor a git directory holding {COMMIT}:{path} "
                 f"({proc.stderr.decode(errors='replace').strip()})")
    return proc.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help=f"a git directory of {REPO}, or a folder holding the two files")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    source, out = Path(args.source), Path(args.out)
    convert = {"hotpotqa": hotpotqa, "musique": musique}
    converted, meta, dropped = [], {}, Counter()
    for name, (path, license_) in DATASETS.items():
        raw = read_raw(source, path)
        recs = json.loads(raw)
        meta[name] = {"repository": REPO, "commit": COMMIT, "path": path, "license": license_, "split": "train",
                      "records": len(recs), "sha256": hashlib.sha256(raw).hexdigest()}
        converted += [(name, *convert[name](rec), paragraphs(rec)) for rec in recs]
    corpus: dict[str, tuple[str, str]] = {}  # title -> (text, source)
    kept: list[dict] = []
    for name, rec, why, gold, _ in converted:  # gold paragraphs first: a distractor never displaces one
        for title, text in gold:
            corpus.setdefault(title, (text, name))
        if rec is not None and any(corpus[t][0] != text for t, text in gold):
            rec, why = None, f"{name}: a gold paragraph's title holds another text"
        if rec is None:
            dropped[why] += 1
        else:
            rec["source"] = name
            kept.append(rec)
    for name, _, _, _, distractors in converted:
        for title, text in distractors:
            corpus.setdefault(title, (text, name))
    out.mkdir(parents=True, exist_ok=True)
    with (out / "train.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": t, "title": t, "text": text, "metadata": {"source": src, "split": "train"}},
                                ensure_ascii=False) + "\n" for t, (text, src) in corpus.items())
    for name in meta:
        meta[name]["kept"] = sum(r["source"] == name for r in kept)
    (out / "SOURCE.json").write_text(json.dumps({"datasets": meta, "dropped": dict(dropped)}, indent=2) + "\n")
    kinds = Counter(r["template"] for r in kept)
    print(f"{out}: kept {len(kept)} of {len(converted)} questions {dict(kinds)}, {len(corpus)} documents",
          file=sys.stderr)
    for why, n in dropped.most_common():
        print(f"  dropped {n}: {why}", file=sys.stderr)
    print(json.dumps({"kept": len(kept), "documents": len(corpus), "templates": dict(kinds), "dropped": dict(dropped)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
