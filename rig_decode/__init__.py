"""rig_decode: retrieval-interleaved decoding that splices evidence into the live KV cache."""

from .config import ConfigError, RigConfig
from .session import RigSession
from .trace import RetrievalStep, Trace

__all__ = ["ConfigError", "RetrievalStep", "RigConfig", "RigSession", "Trace"]
__version__ = "0.1.0"
