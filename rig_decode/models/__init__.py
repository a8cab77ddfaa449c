from .embedded import EMBEDDED_MODELS, cache_dir, is_pulled, pull
from .loader import ModelLoadError, load_model

__all__ = ["EMBEDDED_MODELS", "ModelLoadError", "cache_dir", "is_pulled", "load_model", "pull"]
