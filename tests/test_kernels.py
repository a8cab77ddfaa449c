"""KV surgery kernels: Triton (interpreter on CPU) against the torch reference, and eviction in the
runner against a fresh prefill of the kept tokens."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton runs on CPU tensors only in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rig_decode import kernels  # noqa: E402
from rig_decode.engine.runner_hf import HFModelRunner  # noqa: E402
from rig_decode.kernels.rope import rope_of, rope_shift_ref_  # noqa: E402

from .helpers import neighbour_paired_model, one_layer_model, smollm3_one_layer, tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(gen, batch, heads, cols, dim, n, dtype, view):
    """Random keys (optionally a non-contiguous view), n distinct (row, col) pairs, shifts."""
    # The view is taken on DEVICE: moving a view that is not dense would copy it contiguous.
    if view == "slice":  # columns 3.. of a wider buffer
        keys = torch.randn(batch, heads, cols + 5, dim, generator=gen).to(DEVICE, dtype)[:, :, 3:3 + cols]
    elif view == "transposed":  # stored [batch, cols, heads, dim]
        keys = torch.randn(batch, cols, heads, dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    else:
        keys = torch.randn(batch, heads, cols, dim, generator=gen).to(DEVICE, dtype)
    pairs = torch.randperm(batch * cols, generator=gen)[:n]
    rows, cs = pairs // cols, pairs % cols
    shift = torch.randint(-3000, 3000, (n,), generator=gen).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    return keys, rows.to(DEVICE), cs.to(DEVICE), shift.to(DEVICE), inv_freq.to(DEVICE)


@pytest.mark.parametrize("batch,heads,cols,dim,n,dtype,view", [
    (1, 1, 1, 2, 1, torch.float32, "contiguous"),
    (3, 2, 17, 64, 20, torch.float32, "slice"),
    (2, 3, 9, 48, 0, torch.float32, "contiguous"),
    (4, 2, 31, 128, 57, torch.float32, "transposed"),
    (2, 2, 13, 64, 11, torch.bfloat16, "slice"),
])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_matches_reference(batch, heads, cols, dim, n, dtype, view, interleaved):
    pytest.importorskip("triton")
    from rig_decode.kernels.triton_rope import rope_shift_triton_

    gen = torch.Generator().manual_seed(batch * 1000 + cols)
    keys, rows, cs, shift, inv = _case(gen, batch, heads, cols, dim, n, dtype, view)
    ref, out = keys.clone(), keys
    storage = out.data_ptr()
    rope_shift_ref_(ref, rows, cs, shift, inv, interleaved)
    rope_shift_triton_(out, rows, cs, shift, inv, interleaved)
    assert out.data_ptr() == storage
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    if n:  # untouched entries stay bit-equal, rotated ones moved
        touched = torch.zeros(batch, cols, dtype=torch.bool, device=keys.device)
        touched[rows, cs] = True
        before = _case(torch.Generator().manual_seed(batch * 1000 + cols), batch, heads, cols, dim, n, dtype, view)[0]
        assert torch.equal(out.transpose(1, 2)[~touched], before.transpose(1, 2)[~touched])
        assert not torch.allclose(out.transpose(1, 2)[touched].float(), before.transpose(1, 2)[touched].float())


def test_triton_rotates_every_layer_in_one_launch_per_layout(monkeypatch):
    """Layers laid out alike share a launch (a table of their addresses); a layer with other
    strides gets its own, and every layer matches the reference."""
    pytest.importorskip("triton")
    from rig_decode.kernels import triton_rope

    gen = torch.Generator().manual_seed(5)
    cases = [_case(gen, 3, 2, 11, 32, 9, torch.float32, view) for view in ("contiguous", "transposed", "slice")]
    _, rows, cs, shift, inv = cases[0]
    layers = [cases[0][0], cases[1][0], cases[2][0], cases[0][0].clone() * 3]
    expected = [rope_shift_ref_(k.clone(), rows, cs, shift, inv) for k in layers]
    grids, kernel = [], triton_rope._rope_shift_kernel

    class Counting:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_rope, "_rope_shift_kernel", Counting())
    triton_rope.rope_shift_layers_triton_(layers, rows, cs, shift, inv)
    assert sorted(g[2] for g in grids) == [1, 1, 2]  # the two contiguous layers together
    for got, want in zip(layers, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rotations_compose_and_invert():
    gen = torch.Generator().manual_seed(1)
    keys, rows, cs, shift, inv = _case(gen, 2, 2, 8, 32, 10, torch.float64, "contiguous")
    orig = keys.clone()
    rope_shift_ref_(keys, rows, cs, shift, inv)
    rope_shift_ref_(keys, rows, cs, -shift, inv)
    torch.testing.assert_close(keys, orig, atol=1e-5, rtol=1e-5)  # angles are fp32
    a, b = orig.clone(), orig.clone()
    rope_shift_ref_(a, rows, cs, shift, inv)
    rope_shift_ref_(a, rows, cs, shift, inv)
    rope_shift_ref_(b, rows, cs, 2 * shift, inv)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "cohere"])
def test_shift_matches_the_models_own_rope(arch):
    """Shifting a key computed at position p by s equals computing it at p + s (HF's rotary code),
    for either pairing of dimensions."""
    import sys

    model = tiny_model(64) if arch == "llama" else neighbour_paired_model(arch, 600)
    apply_rotary_pos_emb = sys.modules[type(model.model).__module__].apply_rotary_pos_emb
    rope = rope_of(model)
    assert rope.interleaved == (arch == "cohere")
    k = torch.randn(1, 2, 6, 16)  # [batch, heads, positions, head_dim]
    pos, moved = torch.tensor([[0, 5, 9, 100, 1000, 2047]]), torch.tensor([[3, 0, 40, 7, 1500, 1]])
    cos, sin = model.model.rotary_emb(k, pos)
    rotated, _ = apply_rotary_pos_emb(k, k, cos, sin)
    cos2, sin2 = model.model.rotary_emb(k, moved)
    expected, _ = apply_rotary_pos_emb(k, k, cos2, sin2)
    rope_shift_ref_(rotated, torch.zeros(6, dtype=torch.long), torch.arange(6), (moved - pos)[0].float(),
                    rope.inv_freq, rope.interleaved)
    torch.testing.assert_close(rotated, expected, atol=1e-4, rtol=1e-4)


def test_bad_arguments_are_named():
    keys = torch.zeros(1, 1, 4, 8)
    idx = torch.tensor([0])
    with pytest.raises(ValueError, match="inv_freq"):
        kernels.rope_shift_(keys, idx, idx, idx.float(), torch.ones(3))
    with pytest.raises(ValueError, match="1-D of one length"):
        kernels.rope_shift_(keys, idx, torch.tensor([0, 1]), idx.float(), torch.ones(4))
    with pytest.raises(IndexError, match="outside"):
        kernels.rope_shift_(keys, idx, torch.tensor([4]), idx.float(), torch.ones(4))
    with pytest.raises(ValueError, match="rope type"):
        model = tiny_model(64)
        model.model.rotary_emb.rope_type = "dynamic"
        rope_of(model)


def test_a_model_is_probed_once():
    """The probe's two forwards run on the first call only: a runner per request costs none."""
    model, calls = tiny_model(64), []
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    first = rope_of(model)
    assert rope_of(model) is first and len(calls) == 2
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([list(range(3, 23))])
    runner.evict(0, 2, 5)
    assert len(calls) == 3  # the prefill's forward only


def test_a_model_that_cannot_be_probed_is_refused(monkeypatch):
    model = tiny_model(64)
    monkeypatch.setattr(model.model.rotary_emb, "forward", lambda x, position_ids: 1 / 0)
    with pytest.raises(ValueError, match="could not be probed for how it rotates its keys"):
        rope_of(model)
    monkeypatch.undo()
    del model.model.rotary_emb
    with pytest.raises(ValueError, match="has no rotary embedding"):
        rope_of(model)


@pytest.mark.parametrize("arch", ["cohere", "helium"])
def test_a_rope_pairing_neighbouring_dimensions_moves_its_keys(arch):
    """Cohere and Helium rotate the pairs (2i, 2i + 1), not (i, i + d/2): their layout is found
    and eviction rotates those pairs, exactly (one layer: the kept tokens' own cache)."""
    model = neighbour_paired_model(arch, 600)
    assert rope_of(model).interleaved
    ids = torch.randint(3, 600, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([ids])
    runner.evict(0, 4, 12)
    torch.testing.assert_close(runner.step([[5]])[0], _logits(model, ids[:4] + ids[12:] + [5]), atol=2e-4, rtol=2e-4)


def test_a_rope_pairing_dimensions_in_neither_layout_is_refused(monkeypatch):
    """Keys whose dimensions a shift in neither layout moves are refused (eviction too), and the
    cache is left as it was."""
    import transformers.models.llama.modeling_llama as llama

    model = one_layer_model(600)
    apply = llama.apply_rotary_pos_emb
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", lambda q, k, cos, sin: tuple(t.flip(-1) for t in apply(q, k, cos, sin)))
    with pytest.raises(ValueError, match="other pairs of key dimensions"):
        rope_of(model)
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([list(range(3, 23))])
    keys = runner.cache.layers[0].keys.clone()
    with pytest.raises(ValueError, match="other pairs"):
        runner.evict(0, 5, 10)
    assert runner.lengths == [20] and bool(runner.attn.all())
    torch.testing.assert_close(runner.cache.layers[0].keys, keys, atol=0, rtol=0)


def test_a_peft_wrapped_model_moves_its_keys():
    """An nf4 model keeps its adapter unmerged (a PeftModel): its decoder is found through the
    wrapper, and eviction on it is as exact as on the bare model."""
    from peft import LoraConfig, get_peft_model

    model = one_layer_model(600)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False))
    wrapped.eval()
    torch.testing.assert_close(rope_of(wrapped).inv_freq, rope_of(model).inv_freq)
    ids = torch.randint(3, 600, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    runner = HFModelRunner(wrapped, pad_id=0)
    runner.prefill([ids])
    runner.evict(0, 4, 12)
    torch.testing.assert_close(runner.step([[5]])[0], _logits(wrapped, ids[:4] + ids[12:] + [5]), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", ["torch", "triton", "native"])
def test_layers_are_shifted_alike_and_must_share_a_shape(backend, monkeypatch):
    if backend == "native" and not kernels.native.supports(DEVICE):
        pytest.skip("the native extension is not built (tests/test_native.py builds it)")
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("RIG_KERNELS", backend)
    gen = torch.Generator().manual_seed(2)
    keys, rows, cs, shift, inv = _case(gen, 2, 2, 9, 16, 7, torch.float32, "contiguous")
    for interleaved in (False, True):
        layers = [keys.clone(), (keys * 2).clone()]
        expected = [rope_shift_ref_(k.clone(), rows, cs, shift, inv, interleaved) for k in layers]
        versions = [k._version for k in layers]
        out = kernels.rope_shift_layers_(layers, rows, cs, shift, inv, interleaved)
        assert out[0] is layers[0] and out[1] is layers[1]  # in place
        assert all(k._version > v for k, v in zip(layers, versions))  # autograd sees the write
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Refused before any layer is written: another shape or dtype, or two layers sharing memory.
    before = [k.clone() for k in layers]
    buf = torch.randn(2, *keys.shape, device=DEVICE)
    overlapping = buf.view(-1)[16 : 16 + keys.numel()].view(keys.shape)  # buf[0] moved on by one key
    for bad, what in (([*layers, keys[:, :, :4]], "one shape"), ([*layers, keys.double()], "dtype"),
                      ([*layers, layers[0]], "share memory"), ([buf[0], overlapping], "share memory"),
                      ([*layers, keys[:1].expand_as(keys)], "several indices")):
        with pytest.raises(ValueError, match=what):
            kernels.rope_shift_layers_(bad, rows, cs, shift, inv)
    kernels.rope_shift_layers_([buf[1], buf[0]], rows, cs, shift, inv)  # adjacent, not shared: fine
    for got, want in zip(layers, before):
        assert torch.equal(got, want)


# -- eviction in the runner ---------------------------------------------------------------------------


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_eviction_then_decoding_matches_a_fresh_prefill_one_layer():
    """With one layer, a token's key and value depend on the token and its position only, so
    evicting a span and re-rotating what follows leaves exactly the cache of the kept tokens: every
    token decoded afterwards matches a fresh prefill of them."""
    model = one_layer_model(600)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 600, (40,), generator=gen).tolist()
    other = torch.randint(3, 600, (25,), generator=gen).tolist()
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([prompt, other])  # a second, shorter row: holes in the batch
    runner.evict(0, 10, 22)
    runner.evict(1, 0, 5)
    kept = [prompt[:10] + prompt[22:], other[5:]]
    for t in range(4):
        nxt = [[7 + t], [9 + t]]
        logits = runner.step(nxt)
        for row in range(2):
            kept[row] += nxt[row]
            torch.testing.assert_close(logits[row], _logits(model, kept[row]), atol=2e-4, rtol=2e-4)
    runner.compact(force=True)
    assert runner.lengths == [len(k) for k in kept] and runner.num_columns == max(runner.lengths)


@pytest.mark.parametrize("rope", [False, True])
def test_eviction_leaves_the_keys_of_a_layer_without_rope_as_they_are(rope):
    """SmolLM3 runs some layers without RoPE (NoPE): their keys carry no position, so eviction moves
    them unrotated, and decoding afterwards matches a fresh prefill of the kept tokens either way."""
    model = smollm3_one_layer(600, rope=rope, seed=1)
    assert rope_of(model).layers == ([0] if rope else [])
    ids = torch.randint(3, 600, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([ids])
    runner.evict(0, 4, 12)
    torch.testing.assert_close(runner.step([[5]])[0], _logits(model, ids[:4] + ids[12:] + [5]), atol=2e-4, rtol=2e-4)


def test_the_layers_a_model_runs_without_rope_are_found_by_running_it():
    """SmolLM3 marks its NoPE layers (by default every fourth); Cohere2 skips RoPE in its global
    (full-attention) layers without a flag. Either way the probe finds them, and an all-global
    Cohere2 evicts exactly (its keys move unrotated)."""
    import transformers

    config = transformers.SmolLM3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2)
    assert rope_of(transformers.SmolLM3ForCausalLM(config)).layers == [0, 1, 2, 4, 5, 6]
    assert rope_of(tiny_model(100, layers=3)).layers == [0, 1, 2]
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = transformers.Cohere2Config(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=kinds,
                                        sliding_window=4096, logit_scale=1.0, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)
    torch.manual_seed(0)
    rope = rope_of(transformers.Cohere2ForCausalLM(config).eval())
    assert rope.layers == [0, 2] and rope.interleaved
    config.num_hidden_layers, config.layer_types = 1, ["full_attention"]
    model = transformers.Cohere2ForCausalLM(config).eval()
    assert rope_of(model).layers == []
    ids = torch.randint(3, 600, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([ids])
    runner.evict(0, 4, 12)
    torch.testing.assert_close(runner.step([[5]])[0], _logits(model, ids[:4] + ids[12:] + [5]), atol=2e-4, rtol=2e-4)


def _prefilled(seed: int, n: int):
    model = tiny_model(600)
    ids = torch.randint(3, 600, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([ids])
    return model, ids, runner


def test_eviction_at_the_end_is_exact_for_any_depth():
    """Evicting the last tokens (nothing attended to them) equals never having fed them."""
    model, ids, runner = _prefilled(4, 30)
    runner.evict(0, 20, 30)
    torch.testing.assert_close(runner.step([[5]])[0], _logits(model, ids[:20] + [5]), atol=2e-4, rtol=2e-4)


def test_eviction_keeps_first_layer_keys_of_the_kept_tokens():
    """On a deep model, the first layer's keys after eviction equal a fresh prefill's (deeper layers
    keep what the dropped span contributed: the approximation summary mode accepts)."""
    model, ids, runner = _prefilled(5, 50)
    runner.evict(0, 5, 25)
    runner.compact(force=True)
    fresh = HFModelRunner(model, pad_id=0)
    fresh.prefill([ids[:5] + ids[25:]])
    torch.testing.assert_close(runner.cache.layers[0].keys, fresh.cache.layers[0].keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.cache.layers[0].values, fresh.cache.layers[0].values)
    assert not torch.allclose(runner.cache.layers[1].values, fresh.cache.layers[1].values, atol=1e-3)


def test_evict_rejects_bad_spans():
    model = tiny_model(600)
    runner = HFModelRunner(model, pad_id=0)
    runner.prefill([[5, 6, 7, 8]])
    for row, start, end in ((0, 2, 2), (0, -1, 2), (0, 3, 9), (-1, 2, 4), (1, 0, 2), (0.0, 0, 2)):
        with pytest.raises(ValueError, match="cannot evict"):
            runner.evict(row, start, end)
    assert runner.lengths == [4] and bool(runner.attn.all())
