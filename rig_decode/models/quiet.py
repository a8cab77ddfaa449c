"""Third-party start-up noise around peft, silenced message by message where we call peft.

Messages that reach a user of ``rig ask`` through peft alone, none about anything they asked for:

* peft imports bitsandbytes whenever it is installed (``peft/helpers.py``, and its LoRA dispatch),
  and bitsandbytes' CPU backend, on import, asks the ``kernels`` package for an optional CPU kernel
  from the hub and logs that it could not have it ("Failed to load CPU gemm_4bit_forward ..."); with
  ``HF_HUB_OFFLINE=1``, ``kernels`` also logs that it skips the kernel's publisher trust check. rig
  imports bitsandbytes itself only for ``quantization: nf4`` (``nf4_config``, which runs before
  peft, so an nf4 load still shows these notices).
* ``PeftModel.__init__`` reads ``model.is_gradient_checkpointing``, which transformers 5.x
  deprecated with a ``FutureWarning`` (peft's call, not ours).

Everything else, from these libraries or any other, still reaches the user.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

BNB_KERNEL_REPO = "kernels-community/quantization-bitsandbytes"
DROPPED_LOG_MESSAGES = {
    # logger -> the start of the one message dropped from it
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "kernels._internals.hf_hub": f"Skipping publisher trust check for '{BNB_KERNEL_REPO}'",
}
GRADIENT_CHECKPOINTING_WARNING = r"`is_gradient_checkpointing` is deprecated"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextmanager
def quiet_peft() -> Iterator[None]:
    """Import and call peft inside this block: drops the messages above, and nothing else."""
    # peft imports bitsandbytes on its own; its optional-CPU-kernel notices are noise unless nf4 was asked for
    filters = [(logging.getLogger(name), _DropMessage(prefix)) for name, prefix in DROPPED_LOG_MESSAGES.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        with warnings.catch_warnings():
            # peft reads the deprecated `is_gradient_checkpointing` (transformers 5.x); not our call to fix
            warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_WARNING, category=FutureWarning,
                                    module=r"transformers\.modeling_utils")
            yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
