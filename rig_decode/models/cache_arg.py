"""The keyword a transformers model's ``forward`` takes its KV cache by, in the installed release.

transformers renamed ``past_key_values`` to ``cache`` in 5.2x (the old name is deprecated until
5.40); vLLM's CPU build pins a release from before the rename. Every forward that passes a cache
does so as ``model(..., **cache_kw(cache))``, which names it the way the installed release wants.
"""

from __future__ import annotations

import inspect
from functools import cache as _once


@_once
def cache_arg() -> str:
    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kw(cache) -> dict:
    """``{name: cache}`` for a model's forward, under the name this transformers release takes."""
    return {cache_arg(): cache}
