"""Selection between fused ops and the torch reference, bad input, and torch.library integration."""

import os
import subprocess
import sys

import pytest
import torch

import megalite.kernels as K
from megalite.kernels import fused


@pytest.fixture
def spy(monkeypatch):
    """Records which fused functions get called."""
    calls = []
    for name in fused.OPS:
        real = getattr(fused, name)

        def record(*args, _name=name, _real=real):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(fused, name, record)
    return calls


@pytest.mark.usefixtures("require_extension")
def test_qualifying_inputs_take_the_fused_path(spy):
    x = torch.randn(4, 6)
    K.rms_norm(x, torch.ones(6), 1e-5)
    K.bias_gelu(x, torch.zeros(6))
    K.scaled_upper_triang_masked_softmax(torch.randn(2, 3, 3), 1.0)
    assert spy == ["rms_norm", "bias_gelu", "scaled_upper_triang_masked_softmax"]


@pytest.mark.usefixtures("require_extension")
def test_non_qualifying_inputs_fall_back(spy):
    x = torch.randn(6, 4).t()
    torch.testing.assert_close(K.rms_norm(x, torch.ones(6), 1e-5), K.reference.rms_norm(x, torch.ones(6), 1e-5))
    K.bias_gelu(torch.randn(3, 4, dtype=torch.float64), None)
    K.bias_gelu(torch.randn(3, 4), torch.zeros(4, dtype=torch.float64))
    K.scaled_masked_softmax(torch.randn(2, 2, 2, 3, 3), torch.zeros(3, 3, dtype=torch.bool), 1.0)
    assert spy == []


@pytest.mark.usefixtures("require_extension")
def test_switch_turns_fusion_off_and_on(spy):
    assert K.fused_enabled() and all(K.available_ops().values())
    assert set(K.available_ops()) == set(fused.OPS)
    K.set_fused(False)
    try:
        assert not K.fused_enabled()
        K.layer_norm(torch.randn(2, 3), torch.ones(3), torch.zeros(3), 1e-5)
        assert spy == []
    finally:
        K.set_fused(True)
    K.layer_norm(torch.randn(2, 3), torch.ones(3), torch.zeros(3), 1e-5)
    assert spy == ["layer_norm"]


@pytest.mark.slow
def test_env_var_disables_fusion_and_cli_reports():
    env = dict(os.environ, MEGALITE_NO_FUSED="1")
    report = subprocess.run([sys.executable, "-m", "megalite.kernels"], env=env, capture_output=True, text=True,
                            check=True).stdout
    assert f"extension built: {fused.BUILT}" in report and "fused calls enabled: False" in report
    for name in fused.OPS:
        assert name in report


@pytest.mark.parametrize("call, message", [
    (lambda: K.rms_norm(torch.randn(2, 5), torch.ones(4), 1e-5), r"weight has shape \(4,\), expected \(5,\)"),
    (lambda: K.layer_norm(torch.randn(2, 5), torch.ones(5), torch.ones(3), 1e-5), r"bias has shape \(3,\)"),
    (lambda: K.bias_swiglu(torch.randn(2, 7), None), "must be even, got 7"),
    (lambda: K.apply_rotary(torch.randn(3, 1, 2, 5), torch.randn(3, 1, 2, 5), torch.randn(3, 5), torch.randn(3, 5)),
     "d=5 must be even"),
    (lambda: K.apply_rotary(torch.randn(3, 1, 2, 4), torch.randn(3, 1, 2, 4), torch.randn(2, 4), torch.randn(3, 4)),
     r"cos has shape \(2, 4\), expected \(3, 4\)"),
    (lambda: K.bias_dropout_add(torch.randn(2, 3), None, torch.randn(2, 3), 1.0, True), "p=1.0"),
    (lambda: K.scaled_upper_triang_masked_softmax(torch.randn(2, 3, 4), 1.0), r"sq == sk, got shape \(2, 3, 4\)"),
    (lambda: K.scaled_masked_softmax(torch.randn(2, 3), torch.zeros(4, 3, dtype=torch.bool), 1.0),
     r"mask \(4, 3\) does not broadcast"),
    (lambda: K.permute(torch.randn(4, 3), torch.zeros(5, 2, dtype=torch.long)), r"\(4, 3\) and \(5, 2\)"),
    (lambda: K.unpermute(torch.randn(4, 3), torch.arange(4), torch.rand(3, 2), 2), r"num_tokens=2"),
])
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.usefixtures("require_extension")
@pytest.mark.parametrize("op, args", [
    ("rms_norm_fwd", lambda: (torch.randn(3, 7, requires_grad=True), torch.randn(7, requires_grad=True), 1e-5)),
    ("bias_swiglu_fwd", lambda: (torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True))),
    ("causal_softmax_fwd", lambda: (torch.randn(2, 5, 5, requires_grad=True), 0.5)),
    ("unpermute_fwd", lambda: (torch.randn(5, 4, requires_grad=True), torch.tensor([0, 3, 1, 4, 5]),
                               torch.rand(3, 2, requires_grad=True), 3)),
])
def test_torch_library_registration(op, args):
    """Schema, fake kernel and autograd registration agree with the real kernel (torch.library.opcheck)."""
    torch.library.opcheck(getattr(torch.ops.megalite, op).default, args(),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.usefixtures("require_extension")
def test_fused_ops_trace_under_torch_compile():
    """A graph of fused ops compiles without breaks and matches eager in forward and backward."""

    def block(x, w, b):
        return K.bias_swiglu(K.rms_norm(x, w, 1e-5), b).sum()

    x, w, b = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    eager = block(x, w, b)
    eager_grads = torch.autograd.grad(eager, (x, w, b))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, w, b)
    compiled_grads = torch.autograd.grad(compiled, (x, w, b))
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


def test_apex_norms_only_on_gpu_and_only_when_apex_imports():
    """The PyPI package named apex is unrelated: only NVIDIA apex's norm module is ever used."""
    x = torch.randn(4, 8)
    w, b = torch.randn(8), torch.randn(8)
    assert not K._apex_applies(x, w, b)
    torch.testing.assert_close(K.layer_norm(x, w, b, 1e-5), K.reference.layer_norm(x, w, b, 1e-5))
    if K._APEX_NORMS is None or not torch.cuda.is_available():
        return
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    assert K._apex_applies(xc, wc, bc)
    torch.testing.assert_close(K.layer_norm(xc, wc, bc, 1e-5).cpu(), K.reference.layer_norm(x, w, b, 1e-5))
    torch.testing.assert_close(K.rms_norm(xc, wc, 1e-5).cpu(), K.reference.rms_norm(x, w, 1e-5))
