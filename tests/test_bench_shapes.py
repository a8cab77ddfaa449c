"""What ``bench/gpu.py`` runs, in the single-purpose benchmarks that own it, at the small random
shapes on CPU: the random model in each weight format (``random_qwen.py``), the runner's hop and
zero-prefill hops (``splice.py``), its decode (``decode_step.py``), a long prefill chunked vs not
(``prefill_cap.py``), its evict (``rope_shift.py``), a random index on the device (``retrieval.py``),
each called as the driver calls it and each as its own ``--shapes`` / ``--random-index`` command line."""

import argparse
import math
import sys

import pytest
import torch

from rig_decode.engine import EngineOptions

from .helpers import ROOT, bench_output, run_bench

sys.path.append(str(ROOT / "bench"))  # as when a benchmark runs as a script: its siblings import by name
import prefill_cap  # noqa: E402
import random_qwen  # noqa: E402
import retrieval  # noqa: E402
import rope_shift  # noqa: E402
import splice  # noqa: E402
from timing import Clock, prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return random_qwen.build_model(random_qwen.SHAPES["small"], torch.device("cpu"), torch.float32)


def _gen():
    return torch.Generator().manual_seed(0)


def test_the_small_shapes_are_a_three_layer_qwen2(model):
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (3, 2, 32, 1024)
    assert random_qwen.stored_bytes(model) == sum(p.nbytes for p in model.parameters()) + sum(
        b.nbytes for b in model.buffers())


def test_a_decode_step_reads_the_weights_but_the_embedding_table_and_every_rows_kv(model):
    embed = model.get_input_embeddings().weight.nbytes
    assert random_qwen.weight_bytes(model) == random_qwen.stored_bytes(model) - embed
    per_token = 2 * 3 * 2 * 32 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert random_qwen.decode_bytes(model, 8, 100) == random_qwen.weight_bytes(model) + 8 * 100 * per_token


@pytest.mark.parametrize("quant, cls, bits", [("int8", "Int8Linear", 8), ("int4", "Int4Linear", 4)])
def test_weight_only_formats_quantise_every_linear_layer_and_the_lm_head(quant, cls, bits):
    m = random_qwen.build_model(random_qwen.SHAPES["small"], torch.device("cpu"), torch.float32, quant)
    linears = [n for n, mod in m.named_modules() if type(mod).__name__ == cls]
    assert len(linears) == 3 * 7 + 1 and "lm_head" in linears  # q k v o gate up down per layer, and the head
    assert not any(isinstance(mod, torch.nn.Linear) for mod in m.modules())
    ids = torch.tensor([[5, 6, 7, 8]])
    assert m(input_ids=ids).logits.shape == (1, 4, 1024) and m.dtype == torch.float32
    # Stored: bits per weight plus scales, the embedding and norms as built; far under fp32.
    params = sum(mod.in_features * mod.out_features for mod in m.modules() if type(mod).__name__ == cls)
    weights = random_qwen.stored_bytes(m) - m.get_input_embeddings().weight.nbytes
    assert params * bits / 8 < weights < params * (bits + 1) / 8 + 64 * 1024


def test_auto_quantisation_is_nf4_with_bitsandbytes_else_int4_on_cuda_and_none_on_cpu(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(random_qwen, "has_bitsandbytes", lambda: True)
    assert random_qwen.quantisation("auto", cuda) == ("nf4", torch.bfloat16)
    assert random_qwen.quantisation("auto", cpu) == ("none", torch.float32)
    assert random_qwen.quantisation("nf4", cpu) == ("nf4", torch.bfloat16)
    monkeypatch.setattr(random_qwen, "has_bitsandbytes", lambda: False)
    assert random_qwen.quantisation("auto", cuda) == ("int4", torch.bfloat16)
    assert random_qwen.quantisation("int8", cpu) == ("int8", torch.float32)
    with pytest.raises(SystemExit, match="bitsandbytes"):
        random_qwen.quantisation("nf4", cuda)


def test_the_arguments_build_fewer_layers_and_name_the_format_they_chose():
    ap = argparse.ArgumentParser()
    random_qwen.add_arguments(ap)
    args = ap.parse_args(["--shapes", "small", "--device", "cpu", "--quant", "auto", "--layers", "2"])
    m = random_qwen.from_arguments(args)
    assert m.config.num_hidden_layers == len(m.model.layers) == 2 and m.config.hidden_size == 128
    assert args.quant == "none"
    with pytest.raises(SystemExit):
        random_qwen.shape_of("small", 0)


def test_evidence_segments_lay_a_block_out_as_the_formatter_does():
    segments, leads = splice.evidence_segments(256)
    assert sum(segments) == 256 and len(segments) == len(leads) == 10
    assert segments[0] == 16 and segments[1::2][:4] == [3, 3, 3, 3]  # a head, then each document's number
    assert [bool(lead) for lead in leads] == [False, *[False, True] * 4, False]  # text after a lead


def test_the_runner_hop_and_its_re_prefill(model):
    h = splice.runner_hop(model, 64, 32, 1, Clock("cpu"), _gen())
    assert h["new_tokens"] == 33 and h["splice_syncs"] is None  # syncs are counted on CUDA only
    assert h["splice_ms"] > 0 and h["reprefill_ms"] > 0
    assert h["reprefill_over_splice"] == pytest.approx(h["reprefill_ms"] / h["splice_ms"])
    assert h["evidence_prefill_tok_s"] == pytest.approx(33 * 1e3 / h["splice_ms"])
    assert 64 + 33 <= h["kv_held_slots"] <= 64 + 33 + 64  # its tokens plus spare columns
    assert h["kv_held_bytes"] == h["kv_held_slots"] * 2 * 3 * 2 * 32 * 4  # K and V x layers x heads x dim x fp32


def test_zero_prefill_hops_reuse_the_engines_share(model):
    z = splice.zero_prefill_hop(model, 64, 32, 1, Clock("cpu"), _gen())
    assert z["reused"] == 32 - max(1, math.ceil(EngineOptions().zero_prefill_recompute * 32))
    for kind in splice.ZERO_PREFILL:
        assert z[f"{kind}_ms"] > 0 and z[f"{kind}_syncs"] is None, kind
    cold = splice.cold_pieces(model, 32, 1, Clock("cpu"), _gen())
    assert cold["pieces"] == 10 and cold["cold_pieces_each_ms"] > 0 and cold["cold_pieces_packed_ms"] > 0


def test_evict_on_the_runner(model):
    assert rope_shift.runner_evict_ms(model, 64, 16, 1, Clock("cpu"), _gen()) > 0


def test_a_chunked_prefill_gives_the_logits_of_one_forward(model):
    result = prefill_cap.run(model, 96, [16, None, 40], cap_bytes=None)
    assert [(r["chunk"], r["ok"], r["error"]) for r in result["rows"]] == [(16, True, None), (None, True, None),
                                                                          (40, True, None)]
    assert all(r["ms"] > 0 and "peak_allocated_gib" not in r for r in result["rows"])  # memory: CUDA only
    assert result["compared"]["same_argmax"] is True and result["compared"]["max_abs_diff"] < 1e-4
    assert result["kv_bytes_per_token"] == 2 * 3 * 2 * 32 * 4
    assert prefill_cap.parse_chunks("512,none") == [512, None]
    with pytest.raises(SystemExit):
        prefill_cap.parse_chunks("0")


def test_prefill_holds_the_rows_and_gives_their_next_token_logits(model):
    prompts = [list(range(10, 50)), list(range(100, 120))]
    runner, logits = prefill(model, prompts, kv_budget=1024)
    assert runner.lengths == [40, 20] and logits.shape == (2, model.config.vocab_size)
    for row, ids in zip(logits, prompts):
        want = model(input_ids=torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(row.float(), want, atol=1e-4, rtol=1e-4)


def test_a_random_index_finds_its_own_vectors():
    index = retrieval.DeviceIndex(1000, torch.device("cpu"))
    assert index.backend == "matmul + torch.topk" and index.outside_torch == 0
    assert index.nbytes == 1000 * retrieval.EMBED_DIM * 4
    assert torch.allclose(index.vectors.norm(dim=1), torch.ones(1000), atol=1e-5)
    scores, rows = index.searcher(index.vectors[[3, 500, 999]])()
    assert rows[:, 0].tolist() == [3, 500, 999] and rows.shape == (3, retrieval.TOP_K)
    assert retrieval.search_ms(index, 2, Clock("cpu")) > 0


def test_splice_on_random_shapes_from_the_command_line():
    lines, result = bench_output(run_bench("splice.py", "--shapes", "small", "--device", "cpu", "--contexts", "64,96",
                                           "--evidence", "32", "--repeats", "1", "--threads", "1", timeout=300))
    assert lines[0].split()[:3] == ["context", "splice", "ms"]
    assert result["bench"] == "splice" and result["shapes"] == "small" and result["evidence_tokens"] == 32
    assert [r["context"] for r in result["rows"]] == [64, 96] and set(result["speedup_vs_reprefill"]) == {"64", "96"}
    for r in result["rows"]:
        assert all(r[f"{kind}_ms"] > 0 for kind in splice.ZERO_PREFILL) and r["splice_ms"] > 0
    assert result["pieces"] == 10 and any(line.startswith("cold pieces (10)") for line in lines)


def test_decode_step_on_random_shapes_from_the_command_line():
    """As bench/gpu.py runs it: one weight format, the step kinds, each row beside its bound."""
    _, result = bench_output(run_bench("decode_step.py", "--shapes", "small", "--device", "cpu", "--quant", "int4",
                                       "--steps-kind", "hf,graph", "--batches", "1,2", "--contexts", "16", "--steps",
                                       "2", timeout=300))
    assert result["bench"] == "decode_step" and result["shapes"] == "small" and result["bandwidth_gbs"] > 0
    assert [(r["setup"], r["batch"], r["context"]) for r in result["rows"]] == [
        ("int4 hf", 1, 16), ("int4 graph", 1, 16), ("int4 hf", 2, 16), ("int4 graph", 2, 16)]
    assert all(r["tok_s"] > 0 and r["bound_tok_s"] > 0 and r["pct_of_bound"] >= 0 for r in result["rows"])


def test_prefill_cap_on_random_shapes_from_the_command_line():
    lines, result = bench_output(run_bench("prefill_cap.py", "--shapes", "small", "--device", "cpu", "--quant", "int8",
                                           "--context", "128", "--chunks", "32,none", timeout=300))
    assert lines[0].split()[:2] == ["chunk", "result"] and lines[1].split()[:3] == ["32", "tokens", "ok"]
    assert result["bench"] == "prefill_cap" and (result["quantization"], result["layers"]) == ("int8", 3)
    assert [r["chunk"] for r in result["rows"]] == [32, None] and all(r["ok"] for r in result["rows"])
    assert result["compared"]["same_argmax"] is True


def test_rope_shift_on_random_shapes_times_the_runners_evict():
    lines, result = bench_output(run_bench("rope_shift.py", "--shapes", "small", "--device", "cpu", "--context", "64",
                                           "--span", "16", "--repeats", "1", timeout=300))
    assert (result["model"], result["layers"], result["context"]) == ("small", 3, 64)
    assert result["runner_evict_ms"] > 0 and any(line.startswith("evict") and "runner" in line for line in lines)


def test_retrieval_at_scale_from_the_command_line():
    lines, result = bench_output(run_bench("retrieval.py", "--random-index", "2000", "--device", "cpu", timeout=300))
    assert result["random_index"] == 2000 and result["search_ms"] > 0
    assert result["search_backend"] == "matmul + torch.topk"
    assert result["rerank_ms"] is None and result["rerank_na"] or result["rerank_ms"] > 0
    assert any(line.startswith("top-10 of 2,000") for line in lines)
