"""Marker adapters: resolution, the prompt they were trained with, and the shipped (fp16, no
tokenizer) format loading to the same model as the trained one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from rig_decode.adapters import embedded_adapter, resolve_adapter  # noqa: E402
from rig_decode.config import ConfigError, ModelConfig, RigConfig  # noqa: E402
from rig_decode.markers import MarkerSpec  # noqa: E402
from rig_decode.models.loader import ModelLoadError, load_model, load_tokenizer  # noqa: E402
from rig_decode.prompt import CITE_INSTRUCTION, without_cite_instruction  # noqa: E402
from rig_decode.train.lora import TrainConfig, add_marker_tokens, wrap_lora  # noqa: E402

from .helpers import tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_auto_is_the_shipped_adapter_for_embedded_models_only(tmp_path):
    assert resolve_adapter("smollm2-135m-instruct", None) is None
    assert resolve_adapter(str(tmp_path), "auto") is None  # no adapter ships for a local model
    shipped = embedded_adapter("smollm2-135m-instruct")
    assert shipped is not None and resolve_adapter("smollm2-135m-instruct", "auto") == shipped
    assert resolve_adapter("x", str(tmp_path)) == tmp_path


def test_the_adapters_training_prompt_is_the_default_system_prompt(tmp_path):
    (tmp_path / "rig_adapter.json").write_text(json.dumps({"system_prompt": "Search, then answer."}))
    cfg = RigConfig.from_dict({"model": {"adapter": str(tmp_path)}})
    assert cfg.system_prompt() == "Search, then answer."
    assert RigConfig.from_dict({"model": {"adapter": str(tmp_path)}, "rig": {"system_prompt": "Mine."}}).system_prompt() == "Mine."
    assert RigConfig.from_dict({"model": {"adapter": None}}).system_prompt() is None  # the built-in instruction
    # with citations on, the prompt asks for them (once)
    cite = {"citations": True}
    assert RigConfig.from_dict({"model": {"adapter": str(tmp_path)}, "rig": cite}).system_prompt() == \
        f"Search, then answer. {CITE_INSTRUCTION}"
    assert RigConfig.from_dict({"model": {"adapter": str(tmp_path)},
                                "rig": {**cite, "system_prompt": f"Mine. {CITE_INSTRUCTION}"}}).system_prompt() == \
        f"Mine. {CITE_INSTRUCTION}"
    # the trainer records the prompt without it (citing and plain traces train one adapter)
    assert without_cite_instruction(f"Search, then answer. {CITE_INSTRUCTION}") == "Search, then answer."
    assert without_cite_instruction(None) is None and without_cite_instruction(CITE_INSTRUCTION) is None
    (tmp_path / "rig_adapter.json").write_text("{not json")
    with pytest.raises(ConfigError, match="rig_adapter.json is not valid JSON"):
        cfg.system_prompt()


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    """A tiny base model on disk and an adapter trained-looking (random LoRA) that adds the markers."""
    root = tmp_path_factory.mktemp("adapter")
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    model.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    added = add_marker_tokens(model, tok, MarkerSpec.special_token())
    peft_model = wrap_lora(model, TrainConfig(rank=4, alpha=8, top_layers=1.0), added)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n or "trainable_tokens_delta" in n:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(root / "trained", save_embedding_layers=False)
    tok.save_pretrained(root / "trained")
    (root / "trained" / "rig_adapter.json").write_text(json.dumps(
        {"system_prompt": "Search, then answer.", "marker_style": "special_token",
         "added_tokens": tok.convert_ids_to_tokens(added)}))
    ids = torch.tensor([[5, 6, added[0], 7, added[1], 9]])
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    return root, added, ids, expected


def test_shipped_adapter_loads_to_the_trained_model(base_and_adapter):
    root, added, ids, expected = base_and_adapter
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ship_adapter.py"), str(root / "trained"),
                          "--model", "tiny", "--dest", str(root / "shipped")], capture_output=True, text=True, check=True)
    shipped = json.loads(out.stdout.strip().splitlines()[-1])
    assert "tokenizer.json" not in shipped["files"] and "adapter_model.safetensors" in shipped["files"]
    assert json.loads((root / "shipped" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    for folder in ("trained", "shipped"):
        cfg = ModelConfig(name=str(root / "base"), adapter=str(root / folder), dtype="float32", device="cpu")
        tok = load_tokenizer(cfg)
        assert tok.convert_tokens_to_ids(["<|retrieve|>", "<|endofretrieve|>"]) == added
        model, _ = load_model(cfg)
        assert not hasattr(model, "peft_config"), "LoRA is merged at load"
        with torch.no_grad():
            got = model(input_ids=ids).logits
        tol = 1e-5 if folder == "trained" else 2e-2  # the shipped weights are float16
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_a_folder_without_an_adapter_is_refused(base_and_adapter, tmp_path):
    root = base_and_adapter[0]
    with pytest.raises(ModelLoadError, match="has no adapter_config.json"):
        load_model(ModelConfig(name=str(root / "base"), adapter=str(tmp_path), device="cpu"))
