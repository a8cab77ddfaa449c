"""Marker adapters: where a model's LoRA adapter lives and how it wants to be prompted.

``model.adapter: auto`` (the default) takes the adapter that ships inside the package for an
embedded model (``rig_decode/data/adapters/<model>/``, trained by ``scripts/train_markers.py``),
and none for any other model; ``null`` means no adapter; anything else is a folder.

An adapter folder holds peft's ``adapter_config.json`` and weights, and ``rig_adapter.json``: the
system prompt it was trained with, its marker style and the marker tokens it added to the
tokenizer. The configuration fills ``rig.system_prompt`` and ``rig.marker_style`` from it unless
they are set, so a session prompts the model the way it was trained.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

SETTINGS_FILE = "rig_adapter.json"


def embedded_adapter(model_name: str) -> Path | None:
    """The adapter shipped for an embedded model, if there is one."""
    folder = resources.files("rig_decode") / "data" / "adapters" / model_name.lower()
    return Path(str(folder)) if folder.is_dir() and (folder / "adapter_config.json").is_file() else None


def resolve_adapter(model_name: str, adapter: str | None) -> Path | None:
    if adapter is None:
        return None
    if adapter == "auto":
        return embedded_adapter(model_name)
    return Path(adapter).expanduser()


def adapter_settings(folder: Path | None) -> dict:
    """``rig_adapter.json`` of an adapter folder ({} when there is none)."""
    if folder is None or not (folder / SETTINGS_FILE).is_file():
        return {}
    try:
        settings = json.loads((folder / SETTINGS_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / SETTINGS_FILE} is not valid JSON: {e}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{folder / SETTINGS_FILE} must hold a JSON object")
    return settings
