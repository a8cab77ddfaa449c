"""The marker adapter merged into a checkpoint an outside engine (vLLM) loads: the same tokenizer and
logits as the in-process model with the adapter merged at load, built once per adapter and dtype."""

import pytest
import torch

from rig_decode.config import ModelConfig
from rig_decode.models import merged
from rig_decode.models.loader import load_model, resolve_source
from rig_decode.models.merged import merged_checkpoint

pytestmark = pytest.mark.real_model


def test_the_adapter_is_merged_once_into_a_checkpoint_with_the_in_process_logits(real, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(merged, "cache_dir", lambda: tmp_path)
    cfg = ModelConfig(cpu_gemm="torch")
    path = merged_checkpoint(cfg, "float32")
    assert merged_checkpoint(cfg, "float32") == path  # merged once
    assert [p.name for p in (tmp_path / "merged").iterdir()] == [path.rsplit("/", 1)[-1]]  # no leftovers

    model, tok = load_model(cfg)
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    served_tok = AutoTokenizer.from_pretrained(path)
    assert len(served_tok) == len(tok) == served.get_input_embeddings().weight.shape[0]
    text = "Who founded Korath Labs? <|retrieve|>founder of Korath Labs<|endofretrieve|>"
    ids = tok.encode(text)
    assert served_tok.encode(text) == ids and len(ids) < len(served_tok.encode(text.replace("|>", "| >")))
    with torch.no_grad():
        a = model(input_ids=torch.tensor([ids])).logits
        b = served(input_ids=torch.tensor([ids])).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)

    assert merged_checkpoint(cfg, "bfloat16") != path  # another dtype, another checkpoint
    assert merged_checkpoint(cfg.model_copy(update={"adapter": None}), "float32") == resolve_source(cfg.name)[0]
