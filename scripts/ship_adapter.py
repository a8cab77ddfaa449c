"""Copy a trained marker adapter into the package as an embedded model's default (``model.adapter: auto``).

    python scripts/ship_adapter.py out/adapter-special --model smollm2-135m-instruct

Keeps what loading needs and what documents it: peft's config and weights (cast to float16, half
the size; they are merged into the model's own dtype at load), ``rig_adapter.json`` (prompt, marker
style, added tokens, from which the tokenizer is rebuilt), the model card and ``training.json``.
The saved tokenizer is left out. The base model path in the config becomes the model's name, so
nothing machine-specific ships.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rig_decode.adapters import SETTINGS_FILE


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("adapter", help="folder written by scripts/train_markers.py")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the embedded model it belongs to")
    ap.add_argument("--dest", help="default: rig_decode/data/adapters/<model>")
    args = ap.parse_args(argv)
    src = Path(args.adapter)
    dest = Path(args.dest or Path(__file__).resolve().parents[1] / "rig_decode" / "data" / "adapters" / args.model)
    for name in ("adapter_config.json", "adapter_model.safetensors", SETTINGS_FILE):
        if not (src / name).is_file():
            ap.error(f"{src} has no {name}: not an adapter written by scripts/train_markers.py")
    settings = json.loads((src / SETTINGS_FILE).read_text())
    if settings.get("added_tokens") is None:
        ap.error(f"{src / SETTINGS_FILE} lists no added_tokens; the tokenizer could not be rebuilt")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((src / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = args.model
    if isinstance(config.get("target_modules"), list):  # peft writes a set: keep diffs of the file quiet
        config["target_modules"] = sorted(config["target_modules"])
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # a resized embedding matrix saved beside the adapter (peft's save_embedding_layers) is not
    # needed: the marker rows' trained values are in trainable_tokens_delta
    weights = {k: v.to(torch.float16) if v.is_floating_point() else v
               for k, v in load_file(src / "adapter_model.safetensors").items() if "token_adapter.base_layer" not in k}
    save_file(weights, tmp / "adapter_model.safetensors")
    for name in (SETTINGS_FILE, "README.md", "training.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(json.dumps({"shipped": str(dest), "files": sorted(f.name for f in dest.iterdir()), "bytes": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
