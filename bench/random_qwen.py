"""A Qwen2-architecture model from its config alone, random weights, optionally nf4: what the
benchmarks' ``--shapes`` (``qwen2.5-32b``, or ``small``: three layers that run in seconds on CPU)
measure on, nothing downloaded.

The architecture is created on the meta device and each decoder layer then gets random weights on
the target device, quantised to nf4 (bitsandbytes ``Linear4bit``) before the next layer's weights
exist: a 32B model's 64 GB of bf16 weights never exist at once.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from timing import cap_memory, pick_device  # bench/ is on sys.path when run as a script


SHAPES = {
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, head_dim=128, vocab_size=152064, max_position_embeddings=32768),
    # three layers: CacheBlend's probe forward is stopped at layer 2, as on the 64-layer model
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=4096),
}


def add_arguments(ap, device: bool = True) -> None:
    """``--shapes``, ``--device`` (unless the benchmark has its own), ``--quant`` and ``--cap-gib``, as
    every benchmark on these shapes takes them."""
    ap.add_argument("--shapes", choices=tuple(SHAPES), help="random weights of these shapes (nothing downloaded)")
    if device:
        ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="with --shapes")
    ap.add_argument("--quant", choices=("auto", "nf4", "none"), default="auto",
                    help="with --shapes; auto: nf4 on CUDA, none on CPU")
    ap.add_argument("--cap-gib", type=float, help="with --shapes: cap the card's memory at this many GiB (CUDA)")


def quantisation(choice: str, device: torch.device):
    """(``BitsAndBytesConfig`` or None, compute dtype) for ``--quant auto|nf4|none`` on ``device``:
    auto is nf4 on CUDA (``models.loader.nf4_config``, the settings ``load_model`` quantises with)."""
    from rig_decode.models.loader import ModelLoadError, nf4_config

    quant = None
    if choice == "nf4" or (choice == "auto" and device.type == "cuda"):
        try:
            quant = nf4_config()
        except ModelLoadError as e:
            raise SystemExit(str(e)) from None
    return quant, quant.bnb_4bit_compute_dtype if quant else torch.bfloat16 if device.type == "cuda" else torch.float32


def from_arguments(args) -> Qwen2ForCausalLM:
    """The model ``--shapes`` names, on ``--device``, quantised as ``--quant`` says, built after
    capping the card at ``--cap-gib``."""
    device = pick_device(args.device)
    quant, dtype = quantisation(args.quant, device)
    cap_memory(device, int(args.cap_gib * (1 << 30)) if args.cap_gib else None)
    return build_model(SHAPES[args.shapes], device, dtype, quant)


def qwen2_config(shape: dict) -> Qwen2Config:
    return Qwen2Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       tie_word_embeddings=False)


def _randn(shape, device, dtype, gen, std: float = 0.02) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype, generator=gen).mul_(std)


def _random_linear(meta: nn.Linear, device, dtype, quant, gen) -> nn.Module:
    """A linear layer shaped like ``meta`` with random weights, quantised as ``quant`` (a
    ``BitsAndBytesConfig``) says when given."""
    weight = _randn((meta.out_features, meta.in_features), device, dtype, gen)
    bias = None if meta.bias is None else _randn((meta.out_features,), device, dtype, gen)
    if quant is not None:
        import bitsandbytes as bnb

        how = dict(compress_statistics=quant.bnb_4bit_use_double_quant, quant_type=quant.bnb_4bit_quant_type)
        layer = bnb.nn.Linear4bit(meta.in_features, meta.out_features, bias=bias is not None,
                                  compute_dtype=quant.bnb_4bit_compute_dtype, device="meta", **how)
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, module=layer, **how)
    else:
        layer = nn.Linear(meta.in_features, meta.out_features, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    # Moving a Params4bit quantises it; the bf16 weight is freed when `weight` goes out of scope.
    return layer.to(device)


def _materialise_layer(layer: nn.Module, device, dtype, quant, gen) -> None:
    linears = [(parent, name, child) for parent in layer.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in linears:
        setattr(parent, name, _random_linear(child, device, dtype, quant, gen))
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight = nn.Parameter(torch.ones(norm.weight.shape, device=device, dtype=dtype), requires_grad=False)


@torch.no_grad()
def build_model(shape: dict, device: torch.device, dtype: torch.dtype, quant=None, seed: int = 0) -> Qwen2ForCausalLM:
    """The architecture on the meta device, then filled one decoder layer at a time, so at most one
    layer's full-precision weights exist at any moment."""
    config = qwen2_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    inner = model.model
    inner.embed_tokens.weight = nn.Parameter(_randn(inner.embed_tokens.weight.shape, device, dtype, gen),
                                             requires_grad=False)
    model.lm_head.weight = nn.Parameter(_randn(model.lm_head.weight.shape, device, dtype, gen), requires_grad=False)
    inner.norm.weight = nn.Parameter(torch.ones(inner.norm.weight.shape, device=device, dtype=dtype),
                                     requires_grad=False)
    for layer in inner.layers:
        _materialise_layer(layer, device, dtype, quant, gen)
    inner.rotary_emb = Qwen2RotaryEmbedding(config).to(device)  # its inv_freq was computed on meta
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {', '.join(left[:5])}")
    return model.eval()


def weights_bytes(model: nn.Module) -> int:
    """Parameters and buffers, plus the nf4 scales bitsandbytes keeps beside each packed weight."""
    total = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    for module in model.modules():
        qs = getattr(getattr(module, "weight", None), "quant_state", None)
        if qs is not None:
            total += qs.absmax.nbytes + qs.code.nbytes
            if qs.nested:
                total += qs.state2.absmax.nbytes + qs.state2.code.nbytes
    return total
