from .engine import EngineOptions, RigEngine
from .runner_hf import HFModelRunner
from .sequence import Sequence, SequenceStatus

__all__ = ["EngineOptions", "HFModelRunner", "RigEngine", "Sequence", "SequenceStatus"]
