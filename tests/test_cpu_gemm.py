"""Pre-packed CPU linear layers: same outputs as nn.Linear, batch invariant, inference only."""

import pytest
import torch
from torch import nn

from rig_decode.config import ModelConfig
from rig_decode.models.cpu_gemm import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch build without oneDNN linear packing")


@pytest.mark.parametrize("k,n,bias", [(576, 1536, False), (1536, 576, False), (33, 65, True), (7, 5, True)])
def test_packed_linear_matches_nn_linear(k, n, bias):
    torch.manual_seed(k * n)
    linear = nn.Linear(k, n, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(3, 11, k)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        last = x[:, -1:, :]  # a non-contiguous slice, as logits_to_keep=1 hands the head
        assert not last.is_contiguous()
        torch.testing.assert_close(packed(last), linear(last), rtol=1e-5, atol=1e-5)


def test_a_rows_output_does_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False))
    x = torch.randn(24, 576)
    with torch.no_grad():
        full = packed(x)
        for m in (1, 2, 3, 7, 8, 9, 16, 23):
            assert torch.equal(packed(x[:m]), full[:m]), m
            assert torch.equal(packed(x[-m:]), full[-m:]), m


def test_pack_linears_replaces_plain_fp32_linears_only():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), Custom(8, 8)),
                          nn.Linear(8, 2).to(torch.float64))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert type(model[1][1]) is Custom and type(model[2]) is nn.Linear


def test_packed_linear_refuses_to_train():
    packed = PackedLinear(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="inference-only"):
        packed(torch.randn(2, 4, requires_grad=True))


def test_default_model_decodes_the_same_tokens_packed_or_not():
    from rig_decode.models.loader import load_model

    plain, tok = load_model(ModelConfig(device="cpu", cpu_gemm="torch", adapter=None))
    packed, _ = load_model(ModelConfig(device="cpu", cpu_gemm="packed", adapter=None))
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 30 * 7 + 1  # 7 per layer + head
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a = plain.generate(ids, max_new_tokens=12, do_sample=False)
        b = packed.generate(ids, max_new_tokens=12, do_sample=False)
        torch.testing.assert_close(packed(a).logits, plain(a).logits, rtol=1e-4, atol=1e-3)
    assert a.tolist() == b.tolist()
