"""The core invariant: splicing evidence into the cache == re-prefilling the full token list.

Hops are placed by forcing marker tokens at chosen steps (everything else is the model's own
greedy choice), rows have different prompt lengths, hop at different steps and finish at
different times. Checked three ways: (1) at every step of the spliced batched run, each row's
logits equal a plain cache-free forward over that row's token list; (2) the spliced batch gives
exactly the tokens of the reference engine that re-prefills after every hop; (3) each row gives
the same tokens alone as in the batch.
"""

import pytest
import torch

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ForceScript, LogitRecorder, ScriptedRetriever

PROMPTS = [
    "Which release fixed error E1234 and who approved it?",
    "Release 4.2.1?",
    "The answer is in the evidence. Search for the fact, then answer. Which release fixed error E1234?",
]


def _script(vocab, eos):
    m = vocab.marker_token_ids
    return {
        0: {2: m("error E1234 fixed in release"), 30: m("release 4.2.1 approved by")},
        1: {0: m("who approved 4.2.1"), 25: [eos]},  # a hop at the very first token, then an early stop
        2: {9: m("clause 7.1 priority"), 33: m("data loss"), 50: m("E1234")},
    }


def _run(model, tok, prompts, script, *, reprefill=False, seq_ids=None, style="special_token",
         max_new_tokens=70, recorder=None):
    opts = EngineOptions(max_iterations=3, marker_style=style, max_new_tokens=max_new_tokens,
                         evidence_token_budget=64, top_k=2, reprefill=reprefill)
    extra = ([recorder] if recorder else []) + [ForceScript(script)]
    engine = RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=extra)
    seq_ids = seq_ids or list(range(len(prompts)))
    seqs = [engine.new_sequence(tok.encode(p), seq_id=i) for i, p in zip(seq_ids, prompts)]
    engine.generate(seqs)
    return seqs


def _full_forward_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


SHARED = "Search for the fact, then answer. The answer is in the evidence. " * 2


@pytest.mark.parametrize("style, shared", [("special_token", ""), ("json", ""), ("special_token", SHARED)])
def test_tiny_model_batched_splice_equals_reprefill(model, tok, style, shared):
    """``shared``: a common prompt prefix, prefilled once and copied to every row."""
    vocab = MarkerVocab(tok, MarkerSpec.from_style(style))
    script = _script(vocab, tok.eos_token_id)
    rec = LogitRecorder()
    prompts = [shared + p for p in PROMPTS]
    assert not shared or len(tok.encode(shared)) > 16
    spliced = _run(model, tok, prompts, script, style=style, recorder=rec)

    hops = [s.trace.num_hops for s in spliced]
    assert hops == [2, 1, 3], hops  # the script's hops really happened, at different steps
    assert len({len(s.token_ids) for s in spliced}) == 3  # ragged

    # (1) every recorded step against a cache-free forward of the same token list
    worst = 0.0
    for (sid, n), logits in rec.logits.items():
        seq = spliced[sid]
        ref = _full_forward_logits(model, seq.token_ids[:n])
        worst = max(worst, (logits - ref).abs().max().item())
    assert worst <= 1e-4, worst

    # (2) the reference engine that re-prefills everything after each hop
    reference = _run(model, tok, prompts, script, style=style, reprefill=True)
    for a, b in zip(spliced, reference):
        assert a.token_ids == b.token_ids
        assert a.mask == b.mask

    # (3) alone vs in the batch
    for i, p in enumerate(prompts):
        alone = _run(model, tok, [p], script, style=style, seq_ids=[i])[0]
        assert alone.token_ids == spliced[i].token_ids


def test_post_splice_positions_are_checked(model, tok):
    """The logit check above really covers the steps right after a splice."""
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    rec = LogitRecorder()
    seqs = _run(model, tok, PROMPTS, _script(vocab, tok.eos_token_id), recorder=rec)
    for s in seqs:
        for step in s.trace.retrieval_steps:
            after = step.position + step.evidence_tokens
            assert (s.seq_id, after) in rec.logits
            assert s.mask[step.position : after] == [0] * step.evidence_tokens


@pytest.mark.real_model
def test_real_model_splice_equals_reprefill(real):
    model, tok = real
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    m = vocab.marker_token_ids
    script = {0: {3: m("error E1234 fixed in release")}, 1: {0: m("Priya Raman"), 16: m("release approver")}}
    prompts = [
        "Which release of Helios Gateway fixed error E1234, and who approved that release?",
        "Who is Priya Raman?",
    ]
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for p in prompts]
    rec = LogitRecorder()

    def run(ids, seq_ids, reprefill=False, recorder=None):
        opts = EngineOptions(max_iterations=2, max_new_tokens=36, evidence_token_budget=96, top_k=2,
                             reprefill=reprefill)
        extra = ([recorder] if recorder else []) + [ForceScript(script)]
        engine = RigEngine(model, tok, ScriptedRetriever(), opts, extra_processors=extra)
        seqs = [engine.new_sequence(p, seq_id=i) for i, p in zip(seq_ids, ids)]
        return engine.generate(seqs)

    spliced = run(prompt_ids, [0, 1], recorder=rec)
    assert [s.trace.num_hops for s in spliced] == [1, 2]
    for s in spliced:
        for step in s.trace.retrieval_steps:
            n = step.position + step.evidence_tokens
            diff = (rec.logits[(s.seq_id, n)] - _full_forward_logits(model, s.token_ids[:n])).abs().max().item()
            assert diff <= 1e-4, diff
    for i, ids in enumerate(prompt_ids):
        ref = run([ids], [i], reprefill=True)[0]
        assert ref.token_ids == spliced[i].token_ids


def test_buffered_layer_behaves_like_dynamic_layer():
    """In-place writes into spare columns give the tensors concatenation gives; assigned tensors
    are installed as they are (no spare room, never written to), keys and values independently."""
    from transformers.cache_utils import DynamicLayer

    from rig_decode.models.kv_buffers import BufferedLayer

    torch.manual_seed(0)
    buffered, plain = BufferedLayer(), DynamicLayer()
    for width in (5, 1, 1, 70, 1, 3):  # the fourth write outgrows the first buffer
        k, v = torch.randn(2, 3, width, 4), torch.randn(2, 3, width, 4)
        got, want = buffered.update(k, v), plain.update(k, v)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert buffered.get_seq_length() == plain.get_seq_length()
    installed = torch.randn(2, 3, 10, 4)
    buffered.keys = installed  # e.g. compaction assigns keys first, then reads values to gather them
    assert buffered.values.shape[-2] == 81 and buffered.keys.data_ptr() == installed.data_ptr()
    buffered.values = installed.clone()
    snapshot = installed.clone()
    buffered.update(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))
    assert torch.equal(installed, snapshot), "an installed tensor was written to"
    assert buffered.get_seq_length() == 11 and torch.equal(buffered.keys[:, :, :10], installed)


def test_buffered_layer_relayouts_work_in_place():
    """Adding rows and columns, keeping rows (in order or not) and gathering columns give what
    padding, indexing and gathering give; once the layer has its own buffer, rows joining and
    leaving and compaction happen inside it, and the next write still lands in place."""
    from rig_decode.models.kv_buffers import BufferedLayer

    torch.manual_seed(1)
    layer = BufferedLayer()
    layer.update(torch.randn(4, 2, 6, 4), torch.randn(4, 2, 6, 4))
    buffer = layer.keys.data_ptr()

    def check(relayout, expect):
        before = layer.keys.clone(), layer.values.clone()
        relayout()
        for got, old in zip((layer.keys, layer.values), before):
            assert torch.equal(got, expect(old))
        assert layer.keys.data_ptr() == buffer, "the layer moved to a new buffer"

    check(lambda: layer.select_rows([1, 3]), lambda old: old[[1, 3]])  # rows 0 and 2 leave
    check(lambda: layer.grow(rows=2, columns=3), lambda old: torch.nn.functional.pad(old, (0, 0, 0, 3, 0, 0, 0, 2)))
    check(lambda: layer.select_rows([3, 0, 2]), lambda old: old[[3, 0, 2]])
    order = torch.stack([torch.arange(5), torch.randperm(9)[:5], torch.arange(5)])
    check(lambda: layer.gather_columns(order, rows=[1]),
          lambda old: torch.gather(old, 2, order[:, None, :, None].expand(-1, 2, -1, 4)))
    layer.update(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4))
    assert layer.keys.data_ptr() == buffer and layer.get_seq_length() == 6
    layer.grow(rows=4, columns=0)  # more rows than the buffer has room for: a larger one
    assert layer.keys.shape[0] == 7 and layer.keys.data_ptr() != buffer
    assert not layer.keys[3:].any() and torch.equal(layer.keys[:3, :, 5], torch.ones(3, 2, 4))
    before = layer.keys.clone(), layer.values.clone()
    layer.crop(-2)  # DynamicLayer's own: assigns keys, then reads values to cut them
    for got, old in zip((layer.keys, layer.values), before):
        assert torch.equal(got, old[:, :, :4])


def test_buffered_layer_spare_room():
    """Spare columns come with every move to a larger buffer, spare rows only with rows joining (a
    lone long row does not pay for a second one), and ``max_slots`` bounds the spare room (spare
    rows first, then columns down to ``MIN_SPARE``), never what the rows in use need."""
    from rig_decode.models.kv_buffers import BufferedLayer

    def kv(rows, cols):
        return torch.randn(rows, 2, cols, 4), torch.randn(rows, 2, cols, 4)

    lone = BufferedLayer()
    lone.update(*kv(1, 100))
    assert lone.capacity == 1 * (100 + 64)  # MIN_SPARE columns, no spare row
    lone.update(*kv(1, 100))  # outgrows its columns: more of them, still one row
    assert lone.capacity == 1 * (200 + 64)
    lone.grow(rows=3, columns=0)  # rows joining: room for one more
    assert lone.capacity == 5 * 264 and lone.keys.shape[:3] == (4, 2, 200)
    lone.update(*kv(4, 100))  # outgrowing the columns keeps the spare row
    assert lone.capacity == 5 * 375
    lone.select_rows([2])  # three leave; the next move keeps room for one join, not for them
    lone.update(*kv(1, 100))
    assert lone.capacity == 2 * (400 + 100) and lone.keys.shape[:3] == (1, 2, 400)

    bounded = BufferedLayer(max_slots=950)
    bounded.update(*kv(2, 400))
    assert bounded.capacity == 950  # 2 x (400 + 75): the spare columns (100) shrink to fit
    bounded.grow(rows=1, columns=0)  # 3 rows need more than the bound: no spare row, MIN_SPARE columns
    assert bounded.capacity == 3 * (400 + 64) and bounded.keys.shape[:3] == (3, 2, 400)
    bounded.update(*kv(3, 64))  # fills them in place
    assert bounded.capacity == 3 * 464
    bounded.update(*kv(3, 1))  # then a move, again with MIN_SPARE columns, not one
    assert bounded.capacity == 3 * (465 + 64) and bounded.get_seq_length() == 465


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_rows_write_their_own_columns(attention):
    """Every row writes at its own next column: a row splicing an evidence block leaves the other
    rows' cache untouched (no copy, no hole columns for them), a row behind the widest one decodes
    into its own spare columns without widening the cache, a parked row keeps its place, and each
    row's logits still equal a fresh prefill of its tokens - whichever attention the model uses.
    Each of these steps is one forward over the fed tokens only, packed in one sequence."""
    from rig_decode.engine.runner_hf import HFModelRunner

    from .helpers import tiny_model

    model = tiny_model(600)
    model.set_attn_implementation(attention)
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randint(3, 600, (n,), generator=gen).tolist() for n in (30, 20)]
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill(rows)

    def fresh(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, -1].float()

    forward, fed = model.forward, []
    model.forward = lambda *a, **kw: fed.append(tuple(kw["input_ids"].shape)) or forward(*a, **kw)

    def step(feed):
        fed.clear()
        logits = runner.step(feed)
        assert fed == [(1, sum(map(len, feed)))], "not one packed forward over the fed tokens"
        assert model.config._attn_implementation == attention
        for i, new in enumerate(feed):
            rows[i] += new
            if new:
                torch.testing.assert_close(logits[i], fresh(rows[i]), atol=1e-4, rtol=1e-4)

    before = [layer.keys[1].clone() for layer in runner.cache.layers]
    step([torch.randint(3, 600, (12,), generator=gen).tolist(), [7]])  # row 0 splices, row 1 decodes
    assert runner.num_columns == 42 and runner.ends == [42, 31]
    for layer, old in zip(runner.cache.layers, before):
        assert torch.equal(layer.keys[1, :, :30], old), "a splice wrote into another row's columns"
    for t in range(5):
        step([[5 + t], [9 + t]])
    assert runner.num_columns == 47 and runner.ends == [47, 36]  # row 1 filled its own holes
    step([[], [4]])  # row 0 parked
    assert runner.lengths == [47, 27] and runner.ends == [47, 37]
    step([[8], [6]])
    runner.compact(force=True)  # nothing to drop: row 0 fills every column
    assert runner.num_columns == 48 and runner.lengths == [48, 28] and runner.ends == [48, 38]
    step([[3], [3]])


def test_drop_last_forgets_the_last_tokens_of_aligned_rows_only():
    """What benchmarks use to repeat a step over the same context."""
    from rig_decode.engine.runner_hf import HFModelRunner

    from .helpers import tiny_model

    model = tiny_model(600)
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([[5, 6, 7, 8]])
    first = runner.step([[9, 10]])
    runner.drop_last(2)
    assert runner.lengths == [4] and runner.num_columns == 4
    torch.testing.assert_close(runner.step([[9, 10]]), first)
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([[5, 6, 7, 8], [5, 6]])
    runner.step([[9, 10], [11]])  # row 1's last two tokens are not the last two columns
    with pytest.raises(ValueError, match="cannot drop the last 2 tokens"):
        runner.drop_last(2)


def test_a_row_leaving_leaves_the_cache_as_wide_as_the_longest_row():
    """The KV budget counts rows x the widest request, so when a row leaves, the columns only it
    needed go, and so do the leading holes the batch's first prompts left."""
    from rig_decode.engine.runner_hf import HFModelRunner

    from .helpers import tiny_model

    model = tiny_model(600)
    gen = torch.Generator().manual_seed(12)
    rows = [torch.randint(3, 600, (n,), generator=gen).tolist() for n in (130, 10, 100)]
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill(rows)
    runner.step([[5], [6], [7]])
    runner.select([1, 2])
    assert runner.lengths == [11, 101] and runner.num_columns == 101
    logits = runner.step([[8], [9]])
    for got, ids in zip(logits, (rows[1] + [6, 8], rows[2] + [7, 9])):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_keeping_a_row_the_batch_lacks_is_refused_before_anything_changes():
    """``select`` with a row past the batch (the layers' buffers have a spare row there after a
    join) or a negative one raises, and every row still computes exactly what a fresh prefill does."""
    from rig_decode.engine.runner_hf import HFModelRunner

    from .helpers import tiny_model

    model = tiny_model(600)
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([[5, 6, 7], [8, 9, 10]])
    joined = runner.add_rows([[11, 12, 13]], share_prefix=False)[0]
    runner.step([[1], [2], joined])
    for keep in ([0, 3], [-1, 1], [0, 1.0]):
        with pytest.raises(ValueError, match=r"cannot keep rows .*: the batch has rows 0..2"):
            runner.select(keep)
        assert runner.batch_size == 3 and runner.lengths == [4, 4, 3]
    logits = runner.step([[3], [4], [5]])
    for got, ids in zip(logits, ([5, 6, 7, 1, 3], [8, 9, 10, 2, 4], [11, 12, 13, 5])):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_rows_join_a_cache_that_holds_no_column_yet():
    """A row that joined is cancelled before its first step and the rows left have fed nothing
    either (the cache has spare rows but no columns); more rows join, and the first step computes
    each row exactly."""
    from rig_decode.engine.runner_hf import HFModelRunner

    from .helpers import tiny_model

    model = tiny_model(600)
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([[3, 4, 5]])
    first = runner.add_rows([[6, 7]], share_prefix=False)[0]
    runner.select([1])  # the prefilled row leaves: the joined row has nothing cached
    assert runner.num_columns == 0
    second = runner.add_rows([[8, 9, 10]], share_prefix=False)[0]
    logits = runner.step([first, second])
    for got, ids in zip(logits, ([6, 7], [8, 9, 10])):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_lone_prompt_is_prefilled_with_the_batch_and_becomes_the_cached_prefix():
    """A request joining alone costs no forward of its own: its prompt goes into the next step
    with the other rows, and its KV is then kept as the cached prefix, so a follow-up that extends
    it (the next turn) feeds only its new tokens - and still computes what a fresh prefill does."""
    from rig_decode.engine.runner_hf import HFModelRunner

    from .helpers import tiny_model

    model = tiny_model(600)
    gen = torch.Generator().manual_seed(13)
    other, first = (torch.randint(3, 600, (n,), generator=gen).tolist() for n in (30, 40))
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([other])
    forward, calls = model.forward, []
    model.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
    rest = runner.add_rows([first])
    assert rest == [first] and not calls  # nothing cached in common with it, nothing computed yet
    runner.step([[5], rest[0]])
    assert len(calls) == 1
    follow = first + [7, 8, 9]
    rest = runner.add_rows([follow])
    assert rest == [[7, 8, 9]] and len(calls) == 1  # seeded with all of ``first``
    logits = runner.step([[], [], rest[0]])
    with torch.no_grad():
        want = forward(input_ids=torch.tensor([follow])).logits[0, -1].float()
    torch.testing.assert_close(logits[2], want, atol=1e-4, rtol=1e-4)


def test_the_cached_prefix_is_at_most_shared_prefix_tokens_of_a_prompt(monkeypatch):
    """The cached prefix is a copy beside the rows' KV, so the runner keeps at most
    ``SHARED_PREFIX_TOKENS`` of a lone prompt (and of prompts joining together): a follow-up is
    seeded with that much and prefills the rest, and still computes what a fresh prefill does."""
    from rig_decode.engine import runner_hf

    from .helpers import tiny_model

    monkeypatch.setattr(runner_hf, "SHARED_PREFIX_TOKENS", 20)
    model = tiny_model(600)
    gen = torch.Generator().manual_seed(14)
    first, second, third = (torch.randint(3, 600, (n,), generator=gen).tolist() for n in (40, 5, 5))
    runner = runner_hf.HFModelRunner(model, pad_id=0)
    runner.prefill([first])
    assert runner._prefix[0] == first[:20]
    follow = first + [7, 8, 9]
    rest = runner.add_rows([follow])
    assert rest == [follow[20:]]  # seeded with the 20 tokens kept
    logits = runner.step([[4], rest[0]])
    with torch.no_grad():
        want = model(input_ids=torch.tensor([follow])).logits[0, -1].float()
    torch.testing.assert_close(logits[1], want, atol=1e-4, rtol=1e-4)
    runner.reset(0)
    runner.add_rows([first + second, first + third])  # a shared start computed once: capped too
    assert runner._prefix[0] == first[:20]


def test_random_joins_steps_evictions_and_leaves_keep_every_row_exact():
    """A seeded random schedule of what the engine does to the runner (``helpers.random_schedule``):
    on a one-layer model every fed row's logits equal a fresh forward of its kept tokens, and the
    rows' host bookkeeping matches the device's mask after every move."""
    import random

    from rig_decode.engine.runner_hf import HFModelRunner

    from .helpers import one_layer_model, random_schedule

    model = one_layer_model(600)
    kinds = random_schedule(model, HFModelRunner(model, pad_id=0), random.Random(5), moves=60,
                            feed_sizes=[0, 1, 1, 1, 3])
    assert min(kinds.values()) >= 3, kinds  # the schedule exercised every move
