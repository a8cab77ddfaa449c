import json
import subprocess
import sys

import pytest

from rig_decode.engine.kv import (FAISS_GPU_SCRATCH, GiB, MiB, NF4_BITS, OUTSIDE_TORCH, SHARED_PREFIX_TOKENS,
                                  buffer_columns, kv_bytes_per_token_of, parse_bytes, plan_memory,
                                  prefill_activation_bytes, resolve_architecture)

# Qwen2.5-32B: hidden 5120, MLP 27648, 64 layers, 40 query heads and 8 KV heads of 128.
H, INTER, LAYERS, Q, KV, VOCAB = 5120, 27648, 64, 40 * 128, 8 * 128, 152064
LINEAR = LAYERS * (H * Q + 2 * H * KV + Q * H + 3 * H * INTER)
NORMS_BIAS = LAYERS * 2 * H + H + LAYERS * (Q + 2 * KV)
INDEX_1M = dict(index_vectors=1_000_000, index_dim=384)


def test_qwen32b_nf4_weights_and_kv_by_hand():
    weights = int(LINEAR * NF4_BITS / 8 + (2 * VOCAB * H + NORMS_BIAS) * 2)  # embeddings and LM head in bf16
    per_token = 2 * LAYERS * 8 * 128 * 2
    assert per_token == 256 * 1024  # 256 KiB per token in bf16
    plan = plan_memory("qwen2.5-32b", parse_bytes("24GB"))
    assert plan.weights_bytes == weights and plan.kv_bytes_per_token == per_token
    assert 17.5 < weights / GiB < 18.5
    assert plan.max_kv_tokens == (24 * GiB - plan.fixed_bytes) // per_token


def test_int4_is_4_25_bits_with_the_lm_head_and_int8_quantizes_the_head():
    from rig_decode.models.weight_only import INT4_GROUP

    assert INT4_GROUP == 128  # kv.py's copy of it
    int4 = plan_memory("qwen2.5-32b", 24 * GiB, "int4")
    # 4 bits + a bf16 scale and zero per 128 weights, for every linear layer and the LM head; bf16 embeddings
    assert int4.weights_bytes == (LINEAR + VOCAB * H) * 4.25 / 8 + (VOCAB * H + NORMS_BIAS) * 2
    int8 = plan_memory("qwen2.5-32b", 24 * GiB, "int8")
    scales = LAYERS * 2 * (Q + 2 * KV + H + 2 * INTER + H) + 2 * VOCAB  # a bf16 scale per output channel
    assert int8.weights_bytes == LINEAR + VOCAB * H + scales + (VOCAB * H + NORMS_BIAS) * 2


def test_qwen32b_int4_8k_and_a_1m_index_fit_24gib_by_a_margin_of_the_card_less_every_part():
    plan = plan_memory("qwen2.5-32b", parse_bytes("24GiB"), "int4", context=8192, **INDEX_1M)
    parts = [plan.weights_bytes, plan.kv_bytes, plan.activation_bytes, plan.graph_pool_bytes, plan.index_bytes,
             plan.index_scratch_bytes, plan.outside_torch_bytes, plan.prefix_bytes]
    assert plan.fits and plan.margin_bytes == 24 * GiB - sum(parts) > 0.25 * GiB
    assert plan.prefix_bytes == SHARED_PREFIX_TOKENS * 256 * 1024  # the runner's cap, not the 8k prompt
    assert plan.kv_bytes == 8192 * 256 * 1024 and plan.index_bytes == 1_000_000 * 384 * 4
    assert plan.index_scratch_bytes == FAISS_GPU_SCRATCH and plan.outside_torch_bytes == OUTSIDE_TORCH
    assert 0 < plan.activation_bytes < 0.5 * GiB and 0 < plan.graph_pool_bytes < 0.5 * GiB
    assert plan.max_kv_tokens * plan.kv_bytes_per_token <= plan.kv_bytes + plan.margin_bytes
    assert plan.max_kv_tokens >= 8192 and "fits, margin" in plan.table()


def test_nf4_keeps_its_lm_head_in_bf16_and_dequantizes_a_weight_to_prefill():
    int4 = plan_memory("qwen2.5-32b", 24 * GiB, "int4", **INDEX_1M)
    nf4 = plan_memory("qwen2.5-32b", 24 * GiB, "nf4", **INDEX_1M)
    assert nf4.weights_bytes > int4.weights_bytes  # 4.127 bits, but a 152k x 5120 bf16 LM head
    assert nf4.activation_bytes - int4.activation_bytes == INTER * H * 2  # one gate/up/down weight in bf16
    assert nf4.margin_bytes == 24 * GiB - nf4.total_bytes < int4.margin_bytes


def test_prefill_activations_are_bounded_by_the_chunk_and_not_by_the_layers():
    _, arch = resolve_architecture("qwen2.5-32b")
    at = {c: prefill_activation_bytes(arch, c, 8192) for c in (256, 512, 2048, 8192)}
    assert at[256] < at[512] < at[2048] < at[8192]
    assert at[8192] > 3 * 8192 * INTER * 2  # unchunked: the MLP's three [8192, 27648] bf16 tensors
    assert at[512] < 0.3 * GiB  # chunked: the repeated keys and values over 8k dominate
    # what grows with the context: the keys and values repeated per query head, and the causal mask
    assert prefill_activation_bytes(arch, 512, 16384) - at[512] == 2 * 8192 * Q * 2 + 512 * 8192
    deeper = resolve_architecture("qwen2.5-7b")[1]  # same formula, other widths: the layers never enter
    assert prefill_activation_bytes(deeper, 512, 8192) < at[512]


def test_the_plan_counts_sequences_context_and_chunk():
    one = plan_memory("qwen2.5-32b", 80 * GiB, "int4")
    four = plan_memory("qwen2.5-32b", 80 * GiB, "int4", sequences=4, context=4096)
    assert four.kv_bytes == 4 * 4096 * one.kv_bytes_per_token
    assert four.graph_pool_bytes > one.graph_pool_bytes  # the graph's rows x columns
    unchunked = plan_memory("qwen2.5-32b", 80 * GiB, "int4", prefill_chunk="none")
    assert unchunked.activation_bytes > 1 * GiB > one.activation_bytes
    assert unchunked.prefill_chunk_tokens is None and buffer_columns(8192) == 10240


def test_plan_errors_misfits_and_units():
    assert parse_bytes("24GB") == parse_bytes("24GiB") == parse_bytes("24G") == 24 * GiB
    assert parse_bytes("512MB") == 512 * MiB
    small = plan_memory("qwen2.5-32b", parse_bytes("16GB"))
    assert not small.fits and small.max_kv_tokens == 0 and "does not fit, short by" in small.table()
    assert not plan_memory("qwen2.5-32b", parse_bytes("24GB"), quantization="none").fits
    with pytest.raises(ValueError, match="quantization"):
        plan_memory("qwen2.5-32b", 24 * GiB, quantization="int3")
    with pytest.raises(ValueError, match="name a model"):
        plan_memory("", 24 * GiB)


def _rig_plan(*args):
    return subprocess.run([sys.executable, "-m", "rig_decode.cli", "plan", *args], capture_output=True, text=True,
                          timeout=180)


def test_rig_plan_cli_shows_the_32b_int4_fit_and_json():
    out = _rig_plan("qwen2.5-32b", "--gpu-mem", "24GiB", "--quantization", "int4", "--context", "8192",
                    "--index-vectors", "1000000", "--index-dim", "384")
    assert out.returncode == 0, out.stderr
    for line in ("weights", "KV cache", "prefill activations", "decode graph pool", "index", "outside torch",
                 "fits, margin", "KV budget", "256 KiB"):
        assert line in out.stdout
    js = _rig_plan("--model", "qwen2.5-32b", "--gpu-mem", "24GB", "--json")
    expected = plan_memory("qwen2.5-32b", 24 * GiB)
    assert json.loads(js.stdout)["max_kv_tokens"] == expected.max_kv_tokens
    assert json.loads(js.stdout)["margin_bytes"] == expected.margin_bytes
    misfit = _rig_plan("qwen2.5-32b", "--gpu-mem", "16GiB")
    assert misfit.returncode == 1 and "does not fit, short by" in misfit.stdout


def test_kv_bytes_of_a_loaded_model(model):
    cfg = model.config
    assert kv_bytes_per_token_of(model) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4


def test_rig_plan_names_a_bad_option():
    out = _rig_plan("qwen2.5-32b", "--context", "8k")
    assert out.returncode == 2 and "argument --context: invalid int value: '8k'" in out.stderr
    out = _rig_plan("qwen2.5-32b", "--quantization", "int3")
    assert out.returncode == 2 and "quantization is one of nf4, int4, int8, none" in out.stderr
