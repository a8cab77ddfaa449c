from importlib import import_module

from .embedded import DEFAULT_MODEL, EMBEDDED_MODELS, cache_dir, is_pulled, pull

_LOADER = ("ModelLoadError", "load_model")  # the loader needs the config schema; loaded on first use

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "ModelLoadError", "cache_dir", "is_pulled", "load_model", "pull"]


def __getattr__(name: str):
    if name not in _LOADER:
        raise AttributeError(f"module 'rig_decode.models' has no attribute {name!r}")
    return getattr(import_module(".loader", __name__), name)
