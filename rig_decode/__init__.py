"""rig_decode: retrieval-interleaved decoding that splices evidence into the live KV cache.

The public names load on first use, so a submodule (``rig_decode.train``, say) imports without the
serving stack: the training script needs torch, transformers and peft only.
"""

from importlib import import_module

_PUBLIC = {"ConfigError": ".config", "RigConfig": ".config", "RigSession": ".session",
           "RetrievalStep": ".trace", "Trace": ".trace"}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'rig_decode' has no attribute {name!r}")
    value = getattr(import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value
