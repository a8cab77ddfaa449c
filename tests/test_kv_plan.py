import json
import subprocess
import sys

import pytest

from rig_decode.engine.kv import GiB, NF4_BITS, kv_bytes_per_token_of, parse_bytes, plan_memory


def test_qwen32b_nf4_on_24gb_by_hand():
    # Qwen2.5-32B: hidden 5120, MLP 27648, 64 layers, 40 query heads and 8 KV heads of 128.
    h, inter, layers, q, kv, vocab = 5120, 27648, 64, 40 * 128, 8 * 128, 152064
    linear = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    other = 2 * vocab * h + layers * 2 * h + h + layers * (q + 2 * kv)  # embed + head, norms, qkv bias
    weights = int(linear * NF4_BITS / 8 + other * 2)
    per_token = 2 * layers * 8 * 128 * 2
    assert per_token == 256 * 1024  # 256 KiB per token in bf16
    budget = (24 * GiB - weights - int(1.5 * GiB)) // per_token
    plan = plan_memory("qwen2.5-32b", parse_bytes("24GB"))
    assert plan.weights_bytes == weights and plan.kv_bytes_per_token == per_token
    assert plan.max_kv_tokens == budget
    assert 17.5 < weights / GiB < 18.5 and 18_000 < budget < 20_000


def test_plan_errors_and_units():
    assert parse_bytes("24GB") == parse_bytes("24GiB") == parse_bytes("24G") == 24 * GiB
    assert parse_bytes("512MB") == 512 * 1024**2
    with pytest.raises(ValueError, match="does not fit"):
        plan_memory("qwen2.5-32b", parse_bytes("16GB"))
    with pytest.raises(ValueError, match="does not fit"):
        plan_memory("qwen2.5-32b", parse_bytes("24GB"), quantization="none")


def test_rig_plan_cli():
    out = subprocess.run([sys.executable, "-m", "rig_decode.cli", "plan", "--model", "qwen2.5-32b",
                          "--gpu-mem", "24GB"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "256 KiB" in out.stdout and "KV budget" in out.stdout
    js = subprocess.run([sys.executable, "-m", "rig_decode.cli", "plan", "--model", "qwen2.5-32b",
                         "--gpu-mem", "24GB", "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(js.stdout)["max_kv_tokens"] == plan_memory("qwen2.5-32b", 24 * GiB).max_kv_tokens


def test_kv_bytes_of_a_loaded_model(model):
    cfg = model.config
    assert kv_bytes_per_token_of(model) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4
