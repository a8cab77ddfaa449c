import pytest
import torch

from rig_decode.config import ModelConfig
from rig_decode.models.embedded import gguf_path, pull
from rig_decode.models.loader import ModelLoadError, load_model, resolve_source


def test_bad_model_sources(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        resolve_source(str(tmp_path / "m.gguf"))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_source(str(tmp_path))
    with pytest.raises(ValueError, match="unknown embedded model"):
        pull("gpt-17")
    assert resolve_source("Qwen/Qwen2.5-32B-Instruct") == ("Qwen/Qwen2.5-32B-Instruct", {})


def test_nf4_config_is_explicit():
    pytest.importorskip("bitsandbytes")
    from rig_decode.models.loader import nf4_config

    q = nf4_config()
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16


PROMPT = "The capital of France is"


def _greedy(model, tok, n=4):
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:])


@pytest.mark.real_model
def test_gguf_file_loads_the_same_weights(real):
    model, tok = real
    gguf_model, gguf_tok = load_model(ModelConfig(name=str(gguf_path("smollm2-135m-instruct")), device="cpu"))
    ids = torch.tensor([tok.encode(PROMPT)])
    assert gguf_tok.encode(PROMPT) == tok.encode(PROMPT)
    with torch.no_grad():
        a, b = model(ids).logits, gguf_model(ids).logits
    assert (a - b).abs().max().item() < 1e-4


@pytest.mark.real_model
def test_nf4_loads_4bit_layers_and_generates_on_cpu(real):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    model, tok = load_model(ModelConfig(quantization="nf4", device="cpu", adapter=None))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert "Paris" in _greedy(model, tok)
