"""``model.generate()`` with retrieval: rig_decode's engine on a model the user already loaded.

Two doors to the same function:

* ``rig_decode.hf.generate(model, tokenizer=tok, input_ids=..., attention_mask=..., retriever=...)``;
* ``model.generate(input_ids, ..., custom_generate=rig_decode.hf.CUSTOM_GENERATE,
  trust_remote_code=True, tokenizer=tok, retriever=...)``: transformers loads
  ``custom_generate/generate.py`` from that folder, which calls the function here.

The engine runs on ``model`` as it is (any causal LM the in-process backend takes, a 4-bit
``BitsAndBytesConfig`` one included): each row decodes until it writes a marker, the row's search
runs, its evidence is spliced into the row's KV cache, and decoding goes on, under the same hop
budget, query cap and rules as ``RigSession``. It returns what ``generate`` returns: ``sequences``
(each row's input as given, padding included, then everything after it: sampled tokens and the
evidence blocks the model read, right-padded with the pad id), or with ``return_dict_in_generate``
a ``RigGenerateOutput`` that also holds each row's trace (hops, queries, documents) and loss mask.
Generation arguments it does not implement are refused by name, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

CUSTOM_GENERATE = str(Path(__file__).resolve().parent / "hf_generate")
"""The folder to pass as ``custom_generate`` (it holds ``custom_generate/generate.py``)."""

_UNSUPPORTED = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model", "streamer",
                "negative_prompt_ids", "negative_prompt_attention_mask", "num_beams", "num_beam_groups",
                "num_return_sequences", "penalty_alpha", "prompt_lookup_num_tokens", "inputs_embeds",
                "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "force_words_ids",
                "min_new_tokens", "min_length", "constraints", "output_scores", "output_logits",
                "output_attentions", "output_hidden_states", "synced_gpus", "assistant_tokenizer",
                "stop_strings", "top_k", "typical_p", "epsilon_cutoff", "eta_cutoff", "max_length")
"""Arguments ``generate`` takes that this engine does not implement: refused when set to anything
but their no-op value."""
_NO_OP = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
          "no_repeat_ngram_size": 0, "min_new_tokens": 0, "min_length": 0, "output_scores": False,
          "output_logits": False, "output_attentions": False, "output_hidden_states": False, "synced_gpus": False,
          "top_k": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
_PASSED_THROUGH = ("generation_config", "use_model_defaults", "custom_generate", "trust_remote_code", "use_cache",
                   "pad_token_id", "bos_token_id", "return_dict_in_generate")
"""Arguments transformers hands a ``custom_generate`` function that need no action here."""


@dataclass
class RigGenerateOutput:
    """``return_dict_in_generate=True``: ``generate``'s output plus what retrieval did per row."""

    sequences: torch.LongTensor
    traces: list = field(default_factory=list)
    """Per row: ``rig_decode.trace.Trace`` (hops, queries, documents, timings)."""
    masks: list[list[int]] = field(default_factory=list)
    """Per row, over its tokens after the input: 1 where the model sampled, 0 for evidence."""

    def __getitem__(self, key):  # generate's outputs are read by key too: out["sequences"]
        return getattr(self, key)


def generate(model, input_ids: torch.Tensor | None = None, *, tokenizer=None, attention_mask=None, retriever=None,
             config=None, max_new_tokens: int | None = None, do_sample: bool | None = None,
             temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
             eos_token_id=None, max_iterations: int | None = None, return_dict_in_generate: bool = False,
             inputs: torch.Tensor | None = None, **kwargs):
    """See the module docstring. ``retriever``: any object with ``search_batch(queries, top_k,
    filters=None)`` (None: the one ``config.retriever`` describes, the bundled demo by default);
    ``config``: a ``RigConfig`` for the engine's rules (hop budget, query cap, evidence budget);
    ``max_iterations`` overrides its hop budget. ``eos_token_id`` (an id or ids) ends a row, as in
    ``generate``; by default the model's and tokenizer's."""
    from .config import RigConfig
    from .engine import RigEngine
    from .session import engine_options

    _refuse_unsupported(kwargs)
    if tokenizer is None:
        raise ValueError("rig_decode.hf.generate needs tokenizer= (the markers are found by their token ids)")
    ids = input_ids if input_ids is not None else inputs
    if ids is None:
        raise ValueError("generate needs input_ids")
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    if any(not p for p in prompts):
        raise ValueError("a row of input_ids has no token its attention_mask keeps")
    cfg = config or RigConfig()
    if retriever is None:
        from .retrieval.factory import build_retriever

        retriever = build_retriever(cfg.retriever)
    defaults = getattr(model, "generation_config", None)
    sampling = bool(do_sample) if do_sample is not None else bool(getattr(defaults, "do_sample", False))
    temp = (temperature if temperature is not None else getattr(defaults, "temperature", None) or 1.0) if sampling \
        else 0.0
    opts = engine_options(cfg, model, max_batch_size=max(len(prompts), cfg.engine.max_batch_size), temperature=temp,
                          top_p=top_p if top_p is not None else cfg.model.top_p,
                          **({} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}),
                          **({} if max_iterations is None else {"max_iterations": max_iterations}),
                          **({} if seed is None else {"seed": seed}))
    eos = None if eos_token_id is None else list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) \
        else [eos_token_id]
    engine = RigEngine(model, tokenizer, retriever, opts, eos_ids=eos)
    try:
        seqs = engine.generate([engine.new_sequence(p, seq_id=i) for i, p in enumerate(prompts)])
    finally:
        engine.close()
    for s in seqs:
        if s.finish_reason == "error":
            raise RuntimeError(f"row {s.seq_id} failed: {'; '.join(s.trace.engine_errors)}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else engine.stop_ids[0]
    tails = [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]
    width = max(len(t) for t in tails)
    out = torch.full((ids.shape[0], ids.shape[1] + width), pad, dtype=torch.long)
    out[:, : ids.shape[1]] = ids
    for i, tail in enumerate(tails):
        out[i, ids.shape[1]: ids.shape[1] + len(tail)] = torch.tensor(tail, dtype=torch.long)
    if not return_dict_in_generate:
        return out
    return RigGenerateOutput(out, [s.trace for s in seqs], [s.mask[len(p):] for s, p in zip(seqs, prompts)])


def _refuse_unsupported(kwargs: dict) -> None:
    for name in _PASSED_THROUGH:
        kwargs.pop(name, None)
    bad = [k for k in _UNSUPPORTED if kwargs.get(k) is not None and kwargs.get(k) != _NO_OP.get(k, None)]
    unknown = sorted(set(kwargs) - set(_UNSUPPORTED))
    if bad or unknown:
        raise ValueError(f"rig_decode's generate does not implement {', '.join(sorted(bad + unknown))}; it takes "
                         "input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_p, seed, "
                         "eos_token_id, return_dict_in_generate, and retriever, config, max_iterations")
