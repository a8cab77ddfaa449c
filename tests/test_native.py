"""The native extension rig_decode._C (``rope_shift_layers_``) against the plain-torch reference.

The module builds the extension (scripts/build_native.sh) when it is not built yet, and is skipped
only where it cannot be built: no cmake or no C++ compiler, or RIG_NATIVE=0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rig_decode import kernels
from rig_decode.kernels import native
from rig_decode.kernels.rope import rope_shift_ref_

ROOT = Path(__file__).resolve().parent.parent

TOLERANCE = {  # (atol, rtol): the reference rotates in fp32 and rounds once, as the kernels do
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-5, 1e-6),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}

# Each layout: (the shape of the buffer to allocate, the keys view of it) for [batch, heads, columns, head_dim].
LAYOUTS = {
    "contiguous": (lambda b, h, c, d: (b, h, c, d), lambda buf: buf),
    "column_slice": (lambda b, h, c, d: (b, h, c + 5, d), lambda buf: buf[:, :, 3:-2]),
    "heads_columns_transposed": (lambda b, h, c, d: (b, c, h, d), lambda buf: buf.transpose(1, 2)),
    "strided_head_dim": (lambda b, h, c, d: (b, h, c, 2 * d), lambda buf: buf[..., ::2]),
    "reversed_dims": (lambda b, h, c, d: (d, c, h, b), lambda buf: buf.permute(3, 2, 1, 0)),
}

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", autouse=True)
def built():
    if os.environ.get("RIG_NATIVE") == "0":
        pytest.skip("RIG_NATIVE=0 disables the native extension")
    if native.available(reload=True):
        return
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"cannot build the native extension: {' and '.join(missing)} not found")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_native.sh")], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=1800)
    if proc.returncode:
        pytest.fail(f"scripts/build_native.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    assert native.available(reload=True), native.load_error()


def _device(device: str) -> torch.device:
    if device == "cuda" and not native.supports("cuda"):
        pytest.skip("the native extension was built without its CUDA kernel")
    return torch.device(device)


def _inv_freq(head_dim: int, device="cpu") -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def _case(layout, batch, heads, columns, head_dim, n, dtype, gen, device="cpu", float_shift=False):
    """(buffer, keys view of it, rows, cols, shift, inv_freq) with n distinct (row, column) pairs."""
    shape, view = LAYOUTS[layout]
    buf = torch.randn(shape(batch, heads, columns, head_dim), generator=gen).to(device=device, dtype=dtype)
    flat = torch.randperm(batch * columns, generator=gen)[:n]
    rows, cols = (flat // columns).to(device), (flat % columns).to(device)
    if float_shift:
        shift = (torch.rand(n, generator=gen) * 400 - 200).to(device)
    else:
        shift = torch.randint(-200, 201, (n,), generator=gen).to(device)
    return buf, view, rows, cols, shift, _inv_freq(head_dim, device)


def _check_against_reference(buf, view, rows, cols, shift, inv_freq, interleaved=False):
    expected = buf.clone()
    rope_shift_ref_(view(expected), rows, cols, shift, inv_freq, interleaved)
    keys = view(buf)
    out = native.rope_shift_(keys, rows, cols, shift, inv_freq, interleaved)
    assert out is keys
    atol, rtol = TOLERANCE[buf.dtype]
    # The whole buffer: rotated entries match, everything else (other columns, memory outside the view) is untouched.
    torch.testing.assert_close(buf, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("head_dim", [2, 8, 64, 128])
def test_matches_reference(device, dtype, layout, head_dim):
    device = _device(device)
    gen = torch.Generator().manual_seed(head_dim)
    for interleaved in (False, True):
        for n, float_shift in ((0, False), (1, False), (2, True), (23, False), (39, True)):
            _check_against_reference(*_case(layout, 3, 4, 13, head_dim, n, dtype, gen, device, float_shift), interleaved)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_many_positions(device, dtype):
    # Enough (position, head) pairs to be split across threads.
    gen = torch.Generator().manual_seed(1)
    for interleaved in (False, True):
        _check_against_reference(*_case("column_slice", 4, 8, 301, 64, 1000, dtype, gen, _device(device)), interleaved)


def test_in_place_leaves_other_columns_untouched():
    gen = torch.Generator().manual_seed(2)
    buf, view, rows, cols, shift, inv_freq = _case("column_slice", 2, 3, 9, 16, 5, torch.float32, gen)
    shift[shift == 0] = 7
    before = buf.clone()
    keys = view(buf)
    out = native.rope_shift_(keys, rows, cols, shift, inv_freq)
    assert out is keys
    touched = torch.zeros(buf.shape[0], buf.shape[2], dtype=torch.bool)
    touched[:, 3:-2][rows, cols] = True
    assert torch.equal(buf.transpose(1, 2)[~touched], before.transpose(1, 2)[~touched])
    changed = (buf.transpose(1, 2)[touched] != before.transpose(1, 2)[touched]).flatten(1).any(1)
    assert changed.all()


@pytest.fixture
def op_calls(monkeypatch):
    """The op's calls, recorded instead of run: a bad call must be refused before it."""
    calls = []
    monkeypatch.setattr(torch.ops.rig_decode, "rope_shift_layers_", lambda *args: calls.append(args))
    return calls


def test_bad_arguments_raise_and_leave_keys_untouched(op_calls):
    keys = torch.randn(2, 3, 5, 8)
    before = keys.clone()
    rows, cols, shift, inv_freq = torch.tensor([0, 1]), torch.tensor([4, 2]), torch.tensor([3, -3]), _inv_freq(8)
    with pytest.raises(ValueError, match="inv_freq has 3 entries"):
        native.rope_shift_(keys, rows, cols, shift, inv_freq[:3])
    with pytest.raises(ValueError, match="one length"):
        native.rope_shift_(keys, rows, cols[:1], shift, inv_freq)
    with pytest.raises(ValueError, match="one length"):
        native.rope_shift_(keys, rows, cols, shift[:1], inv_freq)
    with pytest.raises(IndexError, match="outside keys"):
        native.rope_shift_(keys, rows, torch.tensor([4, 5]), shift, inv_freq)
    with pytest.raises(IndexError, match="outside keys"):
        native.rope_shift_(keys, torch.tensor([0, -1]), cols, shift, inv_freq)
    with pytest.raises(IndexError, match="outside keys"):
        native.rope_shift_(keys, torch.tensor([2, 0]), cols, shift, inv_freq)
    with pytest.raises(TypeError, match="int64"):
        native.rope_shift_(keys, rows.int(), cols, shift, inv_freq)
    with pytest.raises(TypeError, match="keys must be float32"):
        native.rope_shift_(keys.int(), rows, cols, shift, inv_freq)
    with pytest.raises(ValueError, match="must be even"):
        native.rope_shift_(torch.randn(2, 3, 5, 7), rows, cols, shift, inv_freq[:3])
    with pytest.raises(ValueError, match="batch, heads, columns, head_dim"):
        native.rope_shift_(keys[0], rows, cols, shift, inv_freq)
    with pytest.raises(ValueError, match="several indices"):
        native.rope_shift_(torch.randn(1, 1, 1, 8).expand(2, 3, 5, 8), rows, cols, shift, inv_freq)
    assert torch.equal(keys, before)
    assert op_calls == []


def test_the_op_checks_its_arguments_itself():
    """The op's own checks, the backstop for calls that bypass ``native.rope_shift_layers_``, raise
    Python errors (in a child process: a crash there is this test's failure, not the run's end)."""
    code = """
import torch
from rig_decode.kernels import native
assert native.available(), native.load_error()
op = torch.ops.rig_decode.rope_shift_layers_
keys, inv_freq = torch.randn(2, 3, 5, 8), 1 / 1e4 ** (torch.arange(0, 8, 2) / 8)
rows, cols, shift = torch.tensor([0, 1]), torch.tensor([4, 2]), torch.tensor([3.0, -3.0])
for args in ((rows, cols, shift, inv_freq[:3]), (rows, torch.tensor([4, 5]), shift, inv_freq),
             (rows.int(), cols, shift, inv_freq)):
    try:
        op([keys], *args)
    except Exception as exc:
        print(type(exc).__name__, str(exc).splitlines()[0])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "ValueError rope_shift_layers_: inv_freq has 3 entries; head_dim 8 needs 4",
        "IndexError rope_shift_layers_: (row, column) index (1, 5) at position 1 is outside keys of shape [2, 3, 5, 8]",
        "TypeError rope_shift_layers_: rows and cols must be int64, got Int and Long",
    ]


# Where the indices are: on CUDA, host indices take the no-sync path, CUDA ones the device check.
PLACES = [("cpu", "host")] + [pytest.param("cuda", place, marks=pytest.mark.gpu)
                              for place in ("host", "device") if torch.cuda.is_available()]


@pytest.mark.parametrize("device, indices_on", PLACES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layers_op_matches_the_reference_on_every_layer(device, indices_on, dtype):
    # Layers of one shape but different strides.
    device = _device(device)
    gen = torch.Generator().manual_seed(4)
    bufs, views = [], []
    for layout in ("contiguous", "column_slice", "heads_columns_transposed", "strided_head_dim"):
        buf, view, rows, cols, shift, inv_freq = _case(layout, 3, 4, 13, 64, 23, dtype, gen, device, True)
        bufs.append(buf)
        views.append(view)
    rows, cols, shift = _case("contiguous", 3, 4, 13, 64, 23, dtype, gen, "cpu", True)[2:5]
    if indices_on == "device":
        rows, cols, shift = rows.to(device), cols.to(device), shift.to(device)
    expected = [buf.clone() for buf in bufs]
    for buf, view in zip(expected, views):
        rope_shift_ref_(view(buf), rows.to(device), cols.to(device), shift.to(device), inv_freq)
    layers = [view(buf) for buf, view in zip(bufs, views)]
    assert native.rope_shift_layers_(layers, rows, cols, shift, inv_freq) is layers
    atol, rtol = TOLERANCE[dtype]
    for got, want in zip(bufs, expected):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    native.rope_shift_layers_([], rows, cols, shift, inv_freq)  # no layers: nothing to do
    native.rope_shift_layers_(layers, rows[:0], cols[:0], shift[:0], inv_freq)  # no positions: nothing moves
    for got, want in zip(bufs, expected):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_the_operator_is_registered_soundly(device):
    """``torch.library.opcheck``: the schema declares what the op mutates, and the op traces under
    fake tensors and ``torch.compile``'s ahead-of-time dispatch (it returns nothing, so torch
    derives its fake kernel)."""
    device = _device(device)
    gen = torch.Generator().manual_seed(6)
    layers = [torch.randn(2, 3, 9, 16, generator=gen).to(device) for _ in range(2)]
    args = (layers, torch.tensor([0, 1, 1]), torch.tensor([3, 5, 8]), torch.tensor([2.0, -1.0, 4.0]),
            _inv_freq(16).to(device))
    for extra in ((), (True,)):  # interleaved: its default, and given
        results = torch.library.opcheck(torch.ops.rig_decode.rope_shift_layers_.default, (*args, *extra))
        assert set(results.values()) == {"SUCCESS"} and "test_faketensor" in results, results


def test_layers_op_checks_every_layer_before_writing_any(op_calls):
    layers = [torch.randn(2, 3, 5, 8) for _ in range(3)]
    before = [k.clone() for k in layers]
    rows, cols, shift, inv_freq = torch.tensor([0, 1]), torch.tensor([4, 2]), torch.tensor([3.0, -3.0]), _inv_freq(8)
    for odd, what in ((torch.randn(2, 3, 6, 8), "one shape"), (torch.randn(2, 3, 5, 8).double(), "dtype"),
                      (torch.randn(1, 1, 1, 8).expand(2, 3, 5, 8), "several indices")):
        with pytest.raises(ValueError, match=what):
            native.rope_shift_layers_([*layers[:2], odd], rows, cols, shift, inv_freq)
    buf = torch.randn(2, 2, 3, 5, 8)
    overlapping = buf.view(-1)[8:8 + buf[0].numel()].view(2, 3, 5, 8)  # buf[0] moved on by one key
    for shared in ([layers[0], layers[1], layers[0]], [buf[0], overlapping]):
        with pytest.raises(ValueError, match="share memory"):
            native.rope_shift_layers_(shared, rows, cols, shift, inv_freq)
    native.rope_shift_layers_([buf[1], buf[0]], rows, cols, shift, inv_freq)  # adjacent, not shared: fine
    assert len(op_calls) == 1
    with pytest.raises(IndexError, match=r"\(1, 5\) at position 1 is outside"):
        native.rope_shift_layers_(layers, rows, torch.tensor([4, 5]), shift, inv_freq)
    with pytest.raises(ValueError, match="inv_freq has 3 entries"):
        native.rope_shift_layers_(layers, rows, cols, shift, inv_freq[:3])
    for got, want in zip(layers, before):
        assert torch.equal(got, want)
    assert len(op_calls) == 1


def test_dispatcher_uses_native_on_cpu(monkeypatch):
    monkeypatch.delenv("RIG_KERNELS", raising=False)
    assert native.supports(torch.device("cpu"))
    assert kernels.backend_for(torch.device("cpu")) == "native"
    gen = torch.Generator().manual_seed(3)
    buf, view, rows, cols, shift, inv_freq = _case("heads_columns_transposed", 2, 2, 7, 32, 6, torch.float32, gen)
    expected = buf.clone()
    rope_shift_ref_(view(expected), rows, cols, shift, inv_freq)
    kernels.rope_shift_(view(buf), rows, cols, shift, inv_freq)
    torch.testing.assert_close(buf, expected, atol=1e-5, rtol=1e-6)


def test_rig_native_0_disables_it(monkeypatch):
    monkeypatch.delenv("RIG_KERNELS", raising=False)
    monkeypatch.setenv("RIG_NATIVE", "0")
    try:
        assert not native.available(reload=True)
        assert "RIG_NATIVE=0" in native.load_error()
        assert not native.supports("cpu")
        assert kernels.backend_for(torch.device("cpu")) == "torch"
    finally:
        monkeypatch.delenv("RIG_NATIVE")
        assert native.available(reload=True), native.load_error()


def test_a_build_of_an_older_schema_is_not_used(monkeypatch):
    """A library built before the op took ``interleaved`` would fail every call: it is reported
    stale, and the torch reference is used."""
    monkeypatch.delenv("RIG_KERNELS", raising=False)
    monkeypatch.setattr(native, "_argument_names", lambda: ["layers", "rows", "cols", "shift", "inv_freq"])
    try:
        assert not native.available(reload=True)
        assert "stale build" in native.load_error() and "build_native.sh" in native.load_error()
        assert kernels.backend_for(torch.device("cpu")) == "torch"
    finally:
        monkeypatch.undo()
        assert native.available(reload=True), native.load_error()


def test_a_forced_backend_that_cannot_serve_the_device_says_so(monkeypatch):
    monkeypatch.setenv("RIG_KERNELS", "native")
    if not native.supports("cuda"):
        with pytest.raises(RuntimeError, match="no cuda kernel"):
            kernels.backend_for(torch.device("cuda"))
    assert kernels.backend_for(torch.device("cpu")) == "native"
    monkeypatch.setenv("RIG_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1" if kernels.has_triton() else "not installed"):
        kernels.backend_for(torch.device("cpu"))
