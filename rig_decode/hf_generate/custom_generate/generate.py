"""``model.generate(..., custom_generate=rig_decode.hf.CUSTOM_GENERATE, trust_remote_code=True,
tokenizer=..., retriever=...)``: transformers imports this file and calls ``generate``, which runs
rig_decode's engine on the model (``rig_decode/hf.py`` says what it takes and returns)."""

from rig_decode.hf import generate as _rig_generate


def generate(model, *args, **kwargs):
    return _rig_generate(model, *args, **kwargs)
