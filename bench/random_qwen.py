"""A Qwen2-architecture model from its config alone, random weights, optionally in 4 or 8 bits:
what the benchmarks' ``--shapes`` (``qwen2.5-32b``, or ``small``: three layers that run in seconds
on CPU) measure on, nothing downloaded.

The architecture is created on the meta device and each linear layer then gets random weights on
the target device, quantised (``--quant``) before the next one's exist, so a 32B model's 64 GB of
bf16 weights never exist at once: ``nf4`` through bitsandbytes (``Linear4bit``, as ``load_model``
quantises; the LM head stays in bf16, as there), ``int8``/``int4`` through torch's own weight-only
kernels (``rig_decode.models.weight_only``, the LM head included, as ``quantize_linears`` does). The
LM head is built first: its quantisation's scratch (a few GB at 152k x 5120) then sits beside
nothing else.

``--quant auto``: ``nf4`` on CUDA where bitsandbytes imports (the format of the GPU tables before
int4 existed, so they stay comparable), else ``int4`` on CUDA (torch's tinygemm kernel; nothing to
install), and no quantisation on CPU. Name the format to compare them.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from rig_decode.models.weight_only import Int4Linear, Int8Linear

from timing import cap_memory, pick_device  # bench/ is on sys.path when run as a script


SHAPES = {
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, head_dim=128, vocab_size=152064, max_position_embeddings=32768),
    # three layers: CacheBlend's probe forward is stopped at layer 2, as on the 64-layer model; a
    # vocabulary divisible by 16, as int4 on CPU needs of the LM head
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=4096),
}
QUANTS = ("auto", "nf4", "int8", "int4", "none")
WEIGHT_ONLY = {"int8": Int8Linear, "int4": Int4Linear}  # torch's own weight-only kernels


def add_arguments(ap, device: bool = True) -> None:
    """``--shapes``, ``--device`` (unless the benchmark has its own), ``--quant``, ``--layers`` and
    ``--cap-gib``, as every benchmark on these shapes takes them."""
    ap.add_argument("--shapes", choices=tuple(SHAPES), help="random weights of these shapes (nothing downloaded)")
    if device:
        ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="with --shapes")
    ap.add_argument("--quant", choices=QUANTS, default="auto",
                    help="with --shapes; auto: nf4 on CUDA with bitsandbytes, else int4 on CUDA, none on CPU")
    ap.add_argument("--layers", type=int, help="with --shapes: build this many of its decoder layers (default: all); "
                    "a faster build and compile, each layer as wide as the shapes say")
    ap.add_argument("--cap-gib", type=float, help="with --shapes: cap the card's memory at this many GiB (CUDA)")


def has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def quantisation(choice: str, device: torch.device) -> tuple[str, torch.dtype]:
    """(weight format, compute dtype) for ``--quant`` on ``device`` (auto: see the module's
    docstring). nf4 computes in bf16 anywhere; the others in bf16 on CUDA and fp32 on CPU (int8 and
    int4 cast to bf16 around their kernels only, as ``weight_only`` does for the CPU default)."""
    if choice not in QUANTS:
        raise ValueError(f"--quant is one of {QUANTS}, got {choice!r}")
    quant = choice
    if choice == "auto":
        quant = "none" if device.type != "cuda" else "nf4" if has_bitsandbytes() else "int4"
    if quant == "nf4" and not has_bitsandbytes():
        raise SystemExit("--quant nf4 needs bitsandbytes (pip install 'rig_decode[gpu]'); --quant int4 does not")
    return quant, torch.bfloat16 if device.type == "cuda" or quant == "nf4" else torch.float32


def shape_of(name: str, layers: int | None = None) -> dict:
    """The shapes ``name`` stands for, with ``layers`` decoder layers when given."""
    shape = dict(SHAPES[name])
    if layers is not None:
        if layers < 1:
            raise SystemExit(f"--layers must be at least 1, got {layers}")
        shape["num_hidden_layers"] = layers
    return shape


def from_arguments(args) -> Qwen2ForCausalLM:
    """The model ``--shapes`` names (``--layers`` of them), on ``--device``, quantised as ``--quant``
    says, built after capping the card at ``--cap-gib``. ``args.quant`` is set to the format used
    (``auto`` resolved), for the benchmark's labels."""
    device = pick_device(args.device)
    args.quant, dtype = quantisation(args.quant, device)
    cap_memory(device, int(args.cap_gib * (1 << 30)) if args.cap_gib else None)
    return build_model(shape_of(args.shapes, getattr(args, "layers", None)), device, dtype, args.quant)


def qwen2_config(shape: dict) -> Qwen2Config:
    return Qwen2Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       tie_word_embeddings=False)


def _randn(shape, device, dtype, gen, std: float = 0.02) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype, generator=gen).mul_(std)


def _random_linear(meta: nn.Linear, device, dtype, quant: str, gen) -> nn.Module:
    """A linear layer shaped like ``meta`` with random weights, in the weight format ``quant``
    (``none``, ``nf4``, ``int8``, ``int4``)."""
    weight = _randn((meta.out_features, meta.in_features), device, dtype, gen)
    bias = None if meta.bias is None else _randn((meta.out_features,), device, dtype, gen)
    if quant == "nf4":
        import bitsandbytes as bnb

        from rig_decode.models.loader import nf4_config

        config = nf4_config()
        how = dict(compress_statistics=config.bnb_4bit_use_double_quant, quant_type=config.bnb_4bit_quant_type)
        layer = bnb.nn.Linear4bit(meta.in_features, meta.out_features, bias=bias is not None,
                                  compute_dtype=config.bnb_4bit_compute_dtype, device="meta", **how)
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, module=layer, **how)
    else:
        layer = nn.Linear(meta.in_features, meta.out_features, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    if quant in WEIGHT_ONLY:  # quantised on the weight's device; the bf16 weight is freed on return
        return WEIGHT_ONLY[quant](layer)
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
def build_model(shape: dict, device: torch.device, dtype: torch.dtype, quant: str = "none",
                seed: int = 0) -> Qwen2ForCausalLM:
    """The architecture on the meta device, then filled one linear layer at a time (the LM head
    first), so at most one layer's full-precision weights exist at any moment. ``quant``: the
    weight format (``none``, ``nf4``, ``int8``, ``int4``)."""
    if quant not in ("none", "nf4", *WEIGHT_ONLY):
        raise ValueError(f"quant is none, nf4, int8 or int4, got {quant!r}")
    config = qwen2_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    inner = model.model
    model.lm_head = _random_linear(model.lm_head, device, dtype, quant if quant in WEIGHT_ONLY else "none", gen)
    inner.embed_tokens.weight = nn.Parameter(_randn(inner.embed_tokens.weight.shape, device, dtype, gen),
                                             requires_grad=False)
    inner.norm.weight = nn.Parameter(torch.ones(inner.norm.weight.shape, device=device, dtype=dtype),
                                     requires_grad=False)
    for layer in inner.layers:
        _materialise_layer(layer, device, dtype, quant, gen)
    inner.rotary_emb = Qwen2RotaryEmbedding(config).to(device)  # its inv_freq was computed on meta
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {', '.join(left[:5])}")
    return model.eval()


def stored_bytes(model: nn.Module) -> int:
    """The weights as the model holds them: parameters and buffers, the nf4 scales bitsandbytes
    keeps beside each packed weight, the biases ``weight_only``'s layers keep as plain tensors, and
    oneDNN-packed fp32 weights (``cpu_gemm: packed``: opaque tensors outside the parameters)."""
    total = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    for module in model.modules():
        qs = getattr(getattr(module, "weight", None), "quant_state", None)
        if qs is not None:
            total += qs.absmax.nbytes + qs.code.nbytes
            if qs.nested:
                total += qs.state2.absmax.nbytes + qs.state2.code.nbytes
        if isinstance(module, tuple(WEIGHT_ONLY.values())) and module.bias is not None:
            total += module.bias.nbytes
        if isinstance(getattr(module, "packed", None), torch.Tensor):  # PackedLinear
            total += module.in_features * module.out_features * 4 + (0 if module.bias is None else module.bias.nbytes)
    return total


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: all it stores but the input embedding table, of
    which a step reads one row per token, unless the LM head reads that table (tied, and neither
    quantized nor packed into a copy of its own)."""
    head = getattr(model.get_output_embeddings(), "weight", None)
    tied = getattr(model.config, "tie_word_embeddings", False) and head is not None and head.is_floating_point()
    return stored_bytes(model) - (0 if tied else model.get_input_embeddings().weight.nbytes)


def decode_bytes(model: nn.Module, batch: int, context: int) -> int:
    """Bytes one decode step reads: the weights once (``weight_bytes``) and the KV of ``batch`` rows
    of ``context`` tokens each. Over a measured bandwidth: the step's bound,
    ``batch x bandwidth / decode_bytes`` tokens/s."""
    from rig_decode.engine.kv import kv_bytes_per_token_of

    return weight_bytes(model) + batch * context * kv_bytes_per_token_of(model)
