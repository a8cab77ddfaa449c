"""Test doubles: a tiny tokenizer and model, a scripted retriever, scripted logits."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, SmolLM3Config, SmolLM3ForCausalLM

from rig_decode.retrieval.base import Hit

_CORPUS = [
    "Which release fixed error E1234 and who approved it?",
    "Release 4.2.1 fixed error E1234; Priya Raman approved it on 2026-01-14.",
    "The answer is in the evidence. Search for the fact, then answer.",
    "<|retrieve|>error E1234 fixed in release<|endofretrieve|>",
    '{"retrieve": "release 4.2.1 approved by"}',
    "<evidence>\n[1] Helios Gateway changelog: release notes\n</evidence>\n",
    "No evidence available.",
    "Grüße aus Köln — naïve café, 東京 and emoji 🚀 text.",
] * 4

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str):
    """A script of the repository (``scripts/...``, ``bench/...``) imported as a module."""
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def run_bench(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``bench/<script>`` run as a user runs it, from the repository root."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def bench_output(proc: subprocess.CompletedProcess) -> tuple[list[str], dict]:
    """A benchmark's table lines and the JSON of its last line, once it exited cleanly."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, proc.stdout
    return lines[:-1], json.loads(lines[-1])


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(special_markers: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (~600 tokens) trained on a few sentences: markers split into
    several tokens, as they do for models that never saw them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    if special_markers:
        fast.add_special_tokens({"additional_special_tokens": ["<|retrieve|>", "<|endofretrieve|>"]})
    return fast


def tiny_model(vocab_size: int, seed: int = 0, max_positions: int = 2048, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 2
    return model


def one_layer_model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    """A one-layer tiny model: each token's key and value depend only on the token and its
    position, so KV moved or computed out of context must equal the in-context KV exactly."""
    model = tiny_model(vocab_size, seed=seed)
    model.config.num_hidden_layers = 1
    model.model.layers = model.model.layers[:1]
    return model


def smollm3_one_layer(vocab_size: int, *, rope: bool, seed: int = 0):
    """A one-layer SmolLM3, with or without RoPE in its layer: SmolLM3 runs some layers without
    position encoding (NoPE), whose cached keys carry no position."""
    torch.manual_seed(seed)
    cfg = SmolLM3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, no_rope_layers=[int(rope)], initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = SmolLM3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 2
    return model


def neighbour_paired_model(arch: str, vocab_size: int, seed: int = 0):
    """A one-layer Cohere or Helium model: both rotate the key pairs (2i, 2i + 1), not (i, i + d/2)."""
    import transformers

    name = arch.capitalize()
    scale = {"logit_scale": 1.0} if arch == "cohere" else {}  # Cohere's default 1/16 shrinks every logit error
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **scale)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    model.generation_config.eos_token_id = 2
    return model


class ScriptedRetriever:
    """Deterministic hits derived from the query text; records every batch it was asked."""

    def __init__(self, docs: list[tuple[str, str]] | None = None, delay_s: float = 0.0, fail: bool = False):
        self.docs = docs or [
            ("d1", "Release 4.2.1 fixed error E1234."),
            ("d2", "Priya Raman approved release 4.2.1 on 2026-01-14."),
            ("d3", "Clause 7.1 classifies data loss as priority P1."),
            ("d4", "Helios Gateway terminates TLS and routes requests."),
        ]
        self.delay_s, self.fail = delay_s, fail
        self.batches: list[list[str]] = []
        self._lock = threading.Lock()

    def search_batch(self, queries, top_k, filters=None):
        with self._lock:
            self.batches.append(list(queries))
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("index server unreachable")
        out = []
        for q in queries:
            start = sum(q.encode()) % len(self.docs)
            picked = [self.docs[(start + j) % len(self.docs)] for j in range(min(top_k, len(self.docs)))]
            out.append([Hit(i, t, 1.0 - 0.1 * j, title=f"doc {i}") for j, (i, t) in enumerate(picked)])
        return out


class ForceScript:
    """Forces token sequences at chosen generation steps of chosen sequences (by ``seq_id``):
    ``{seq_id: {step: [ids]}}``. Everything else is the model's own choice."""

    def __init__(self, script: dict[int, dict[int, list[int]]]):
        self.script = script

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            for start, ids in self.script.get(seq.seq_id, {}).items():
                k = seq.num_generated - start
                if 0 <= k < len(ids):
                    scores[i].fill_(float("-inf"))
                    scores[i, ids[k]] = 0.0
        return scores

    def fixed_bans(self, seq):
        """Nothing banned where the script does not force (the engine may push the rest of its
        rules to a server); None where it does."""
        forcing = any(0 <= seq.num_generated - start < len(ids) for start, ids in self.script.get(seq.seq_id, {}).items())
        return None if forcing else frozenset()


class LogitRecorder:
    """Records each row's raw logits, keyed by (seq_id, number of tokens before the sampled one)."""

    def __init__(self):
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            self.logits[(seq.seq_id, len(seq.token_ids))] = scores[i].detach().clone()
        return scores


class MarkersForever:
    """An adversarial 'model': always wants to open a marker, never closes one, never stops."""

    def __init__(self, vocab, filler: int):
        self.vocab, self.filler = vocab, filler
        start = vocab.spec.start[0]
        self.start_next = [vocab.tokenizer.encode(start[s:], add_special_tokens=False)[0] for s in range(len(start))]

    def __call__(self, input_ids, scores):  # also usable inside model.generate
        return scores

    def apply(self, rows, scores):
        for i, row in enumerate(rows):
            m = row.matcher
            scores[i].fill_(-1e4)
            scores[i, self.filler] = -1e3
            want = self.filler if m.is_open else self.start_next[m.start_states[0]]
            scores[i, want] = 0.0
        return scores


def random_schedule(reference, runner, rng, moves: int, feed_sizes: list[int]) -> dict[str, int]:
    """A seeded random schedule of what the engine does to the runner: rows join (with and without
    a shared prefix), feed ragged token counts (drawn from ``feed_sizes``; 0 parks the row), lose
    spans to eviction, leave, and the cache is compacted. On a one-layer model the cache must then
    *be* each row's kept tokens: every fed row's logits equal a fresh forward of them through
    ``reference`` (the runner's model, or a copy of it where hooks on the runner's should see the
    runner's forwards only). The rows' host bookkeeping (real tokens per row, hence ``has_holes``,
    which picks the forward) must match the device's mask after every move. Returns how often each
    move ran."""
    shared = [rng.randrange(3, 600) for _ in range(20)]

    def prompt():
        return (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 600) for _ in range(rng.randint(2, 12))]

    def fresh(ids):
        with torch.no_grad():
            return reference(input_ids=torch.tensor([ids])).logits[0, -1].float()

    def consistent():
        real = runner.attn.bool()
        assert runner.lengths == real.sum(1).tolist() == [len(t) for t in tokens]
        assert runner.has_holes == (not bool(real.all()))

    def step(feed):
        logits = runner.step(feed)
        for i, new in enumerate(feed):
            tokens[i] += new
            if new:
                torch.testing.assert_close(logits[i], fresh(tokens[i]), atol=2e-4, rtol=2e-4)
        consistent()

    first = [prompt() for _ in range(3)]
    tokens = [[] for _ in first]
    runner.reset(0)
    step(runner.add_rows(first))
    kinds = {"step": 0, "join": 0, "evict": 0, "leave": 0, "compact": 0}
    for _ in range(moves):
        kind = rng.choice(["step", "step", "step", "join", "evict", "leave", "compact"])
        if kind == "join" and runner.batch_size < 6:
            new = [prompt() for _ in range(rng.randint(1, 2))]
            rest = runner.add_rows(new, share_prefix=rng.random() < 0.7)
            tokens += [p[: len(p) - len(r)] for p, r in zip(new, rest)]
            consistent()
            step([[] for _ in range(runner.batch_size - len(new))] + rest)
        elif kind == "evict" and max(map(len, tokens)) >= 6:
            row = max(range(len(tokens)), key=lambda i: (len(tokens[i]), rng.random()))
            start = rng.randrange(1, len(tokens[row]) - 3)
            end = rng.randrange(start + 1, len(tokens[row]) - 1)
            runner.evict(row, start, end)
            del tokens[row][start:end]
            consistent()
        elif kind == "leave" and runner.batch_size > 1:
            keep = sorted(rng.sample(range(runner.batch_size), rng.randint(1, runner.batch_size - 1)))
            runner.select(keep)
            tokens = [tokens[i] for i in keep]
            consistent()
        elif kind == "compact":
            runner.compact(force=rng.random() < 0.5)
            consistent()
        else:
            kind = "step"
            feed = [[rng.randrange(3, 600) for _ in range(rng.choice(feed_sizes))] for _ in tokens]
            if not any(feed):
                feed[0] = [7]
            step(feed)
        kinds[kind] += 1
    return kinds
