"""Every fused op against its plain-torch reference: forward and backward, odd sizes, three dtypes."""

import math

import pytest
import torch

import megalite.kernels as K
from megalite.kernels import fused
from megalite.kernels import reference as R

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32 must match to 1e-5; half types to a few units in their last place.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _randn(*shape, device, dtype, requires_grad=True):
    return torch.randn(*shape, device=device).to(dtype).requires_grad_(requires_grad)


def _cases(device, dtype):
    """name -> (args builder, public fn, reference fn); args are rebuilt from a fixed seed."""
    mk = dict(device=device, dtype=dtype)

    def norm_args():
        return (_randn(3, 5, 37, **mk), torch.randn(37, device=device, requires_grad=True),
                torch.randn(37, device=device, requires_grad=True))

    def rotary_args():
        angles = torch.randn(7, 5, device=device)
        emb = torch.cat((angles, angles), dim=-1)
        return _randn(7, 2, 3, 10, **mk), _randn(7, 2, 1, 10, **mk), emb.cos(), emb.sin()

    def strided_rotary_args():
        """q and k as the attention layer makes them: views into one [s, b, groups, heads + 2, d] QKV tensor."""
        _, _, cos, sin = rotary_args()
        qkv = _randn(7, 2, 1, 5, 10, **mk)
        return qkv[:, :, :, :3].reshape(7, 2, 3, 10), qkv[:, :, :, -2], cos, sin

    def causal_mask():
        return torch.rand(2, 1, 6, 9, device=device) < 0.4

    def permute_args():
        experts = torch.randint(-1, 5, (13, 2), device=device)
        experts[3] = -1
        return _randn(13, 11, **mk), experts

    def unpermute_args():
        tokens, experts = permute_args()
        permuted, row_map = R.permute(tokens.detach(), experts)
        return permuted.requires_grad_(), row_map, torch.rand(13, 2, device=device, requires_grad=True), 13

    return {
        "layer_norm": (lambda: (*norm_args(), 1e-5), K.layer_norm, R.layer_norm),
        "rms_norm": (lambda: (*norm_args()[:2], 1e-6), K.rms_norm, R.rms_norm),
        "bias_gelu": (lambda: (_randn(4, 3, 37, **mk), _randn(37, **mk)), K.bias_gelu, R.bias_gelu),
        "bias_gelu_no_bias": (lambda: (_randn(5, 37, **mk) * 3, None), K.bias_gelu, R.bias_gelu),
        "bias_swiglu": (lambda: (_randn(4, 3, 38, **mk), _randn(38, **mk)), K.bias_swiglu, R.bias_swiglu),
        "bias_swiglu_no_bias": (lambda: (_randn(7, 22, **mk), None), K.bias_swiglu, R.bias_swiglu),
        "apply_rotary": (rotary_args, K.apply_rotary, R.apply_rotary),
        "apply_rotary_strided": (strided_rotary_args, K.apply_rotary, R.apply_rotary),
        "bias_dropout_add_eval": (lambda: (_randn(3, 4, 37, **mk), _randn(37, **mk), _randn(3, 4, 37, **mk), 0.3, False),
                                  K.bias_dropout_add, R.bias_dropout_add),
        "bias_dropout_add_train": (lambda: (_randn(3, 4, 37, **mk), _randn(37, **mk), _randn(3, 4, 37, **mk), 0.3, True),
                                   K.bias_dropout_add, R.bias_dropout_add),
        "dropout_add_no_bias": (lambda: (_randn(5, 33, **mk), None, _randn(5, 33, **mk), 0.5, True),
                                K.bias_dropout_add, R.bias_dropout_add),
        "causal_softmax": (lambda: (_randn(2, 3, 9, 9, **mk) * 4, 0.37), K.scaled_upper_triang_masked_softmax,
                           R.scaled_upper_triang_masked_softmax),
        "causal_softmax_3d": (lambda: (_randn(3, 17, 17, **mk), 1.0), K.scaled_upper_triang_masked_softmax,
                              R.scaled_upper_triang_masked_softmax),
        "masked_softmax": (lambda: (_randn(2, 3, 6, 9, **mk) * 4, causal_mask(), 0.37), K.scaled_masked_softmax,
                           R.scaled_masked_softmax),
        "masked_softmax_2d_mask": (lambda: (_randn(2, 3, 6, 9, **mk), torch.rand(6, 9, device=device) < 0.5, 1.3),
                                   K.scaled_masked_softmax, R.scaled_masked_softmax),
        "masked_softmax_key_mask": (lambda: (_randn(2, 3, 6, 9, **mk), torch.rand(2, 1, 1, 9, device=device) < 0.5, 1.0),
                                    K.scaled_masked_softmax, R.scaled_masked_softmax),
        "masked_softmax_query_mask": (lambda: (_randn(3, 6, 9, **mk), torch.rand(3, 6, 1, device=device) < 0.5, 1.0),
                                      K.scaled_masked_softmax, R.scaled_masked_softmax),
        "permute": (permute_args, K.permute, R.permute),
        "permute_top1": (lambda: (_randn(9, 5, **mk), torch.randint(-1, 3, (9, 1), device=device)), K.permute, R.permute),
        "unpermute": (unpermute_args, K.unpermute, R.unpermute),
    }


CASE_NAMES = list(_cases("cpu", torch.float32))


def _run(fn, args, grads_seed):
    """Outputs and input gradients of fn(*args) under a random upstream gradient."""
    torch.manual_seed(1234)
    out = fn(*args)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
    gen = torch.Generator().manual_seed(grads_seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.usefixtures("require_extension")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_fused_matches_reference(name, device, dtype, monkeypatch):
    assert K.fused_enabled()
    _check_fused(name, *_cases(device, dtype)[name], monkeypatch)


def _check_fused(name, make_args, fused_fn, reference_fn, monkeypatch):
    """The public fn takes the fused path and its outputs and input gradients equal the reference's."""
    torch.manual_seed(0)
    args = make_args()
    op = fused_fn.__name__
    real, calls = getattr(fused, op), []
    monkeypatch.setattr(fused, op, lambda *a: calls.append(op) or real(*a))
    fused_out, fused_grads = _run(fused_fn, args, grads_seed=7)
    assert calls == [op], f"{name} did not take the fused path"
    ref_out, ref_grads = _run(reference_fn, args, grads_seed=7)
    assert len(fused_out) == len(ref_out) and len(fused_grads) == len(ref_grads) > 0
    for got, want in zip(fused_out + fused_grads, ref_out + ref_grads):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL[got.dtype])


@pytest.mark.usefixtures("require_extension")
@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_row_gives_zero_probs_and_grads(device):
    x = torch.randn(1, 2, 4, 5, device=device, requires_grad=True)
    mask = torch.zeros(1, 1, 4, 5, dtype=torch.bool, device=device)
    mask[0, 0, 1] = True
    y = K.scaled_masked_softmax(x, mask, 0.5)
    (y * torch.randn_like(y)).sum().backward()
    assert torch.equal(y[:, :, 1], torch.zeros_like(y[:, :, 1]))
    assert torch.equal(x.grad[:, :, 1], torch.zeros_like(x.grad[:, :, 1]))
    torch.testing.assert_close(y[:, :, 0].sum(-1), torch.ones(1, 2, device=device))


@pytest.mark.usefixtures("require_extension")
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_uses_default_generator(device):
    """Same seed, same mask; a forked RNG replays it (activation recompute); about p of x is dropped."""
    x, residual = torch.randn(64, 65, device=device), torch.zeros(64, 65, device=device)
    torch.manual_seed(3)
    first = K.bias_dropout_add(x, None, residual, 0.25, True)
    with torch.random.fork_rng(devices=[torch.device(device)] if device == "cuda" else []):
        torch.manual_seed(3)
        replay = K.bias_dropout_add(x, None, residual, 0.25, True)
    second = K.bias_dropout_add(x, None, residual, 0.25, True)
    assert torch.equal(first, replay)
    assert not torch.equal(first, second)
    kept = first != 0
    assert 0.2 < 1 - kept.float().mean().item() < 0.3
    torch.testing.assert_close(first[kept], x[kept] / 0.75)


def _offset_tensor(*shape, device, dtype, offset):
    """A contiguous tensor starting ``offset`` elements into its storage: offset 1 is not 16-byte aligned, which
    sends the CUDA kernels down their one-element-per-access path; offset 0 takes the 16-byte path."""
    base = torch.randn(math.prod(shape) + offset, device=device).to(dtype)
    return base[offset:].view(shape).detach().requires_grad_()


def _packed_cases(h, dtype, offset):
    """name -> (args builder, public fn, reference fn) at last dim ``h`` (the row kernels' tiers: one warp per
    row, a block per row, 32 and 64 floats per thread), with inputs aligned (offset 0) or not (offset 1).

    Biases take no gradient here: a bias gradient is torch's sum over rows of the kernel's input gradient
    (checked above), and in half precision that sum of separately rounded terms can cancel to a value the
    dtype's tolerance does not cover, although every term is within it."""
    mk = dict(device="cuda", dtype=dtype, offset=offset)
    rows = max(2, 4096 // h)

    def bias():
        return _offset_tensor(h, **mk).detach()

    def w():
        return torch.randn(h, device="cuda", requires_grad=True)

    def rotary_args():
        d = 64 if h <= 4096 else 128
        angles = torch.randn(5, d // 2, device="cuda")
        emb = torch.cat((angles, angles), dim=-1)
        return _offset_tensor(5, 2, 3, d, **mk), _offset_tensor(5, 2, 1, d, **mk), emb.cos(), emb.sin()

    def experts():
        return torch.randint(-1, 4, (rows, 2), device="cuda")

    def unpermute_args():
        permuted, row_map = R.permute(_offset_tensor(rows, h, **mk).detach(), experts())
        return permuted.requires_grad_(), row_map, torch.rand(rows, 2, device="cuda", requires_grad=True), rows

    return {
        "layer_norm": (lambda: (_offset_tensor(rows, h, **mk), w(), w(), 1e-5), K.layer_norm, R.layer_norm),
        "rms_norm": (lambda: (_offset_tensor(rows, h, **mk), w(), 1e-6), K.rms_norm, R.rms_norm),
        "bias_gelu": (lambda: (_offset_tensor(rows, h, **mk), bias()), K.bias_gelu, R.bias_gelu),
        "bias_swiglu": (lambda: (_offset_tensor(rows, h, **mk), bias()), K.bias_swiglu, R.bias_swiglu),
        "apply_rotary": (rotary_args, K.apply_rotary, R.apply_rotary),
        "bias_dropout_add": (lambda: (_offset_tensor(rows, h, **mk), bias(),
                                      _offset_tensor(rows, h, **mk), 0.3, True), K.bias_dropout_add, R.bias_dropout_add),
        "causal_softmax": (lambda: (_offset_tensor(1, 2, min(h, 4096), min(h, 4096), **mk) * 4, 0.37),
                           K.scaled_upper_triang_masked_softmax, R.scaled_upper_triang_masked_softmax),
        "masked_softmax": (lambda: (_offset_tensor(2, 1, 3, h, **mk) * 4,
                                    torch.rand(2, 1, 1, h, device="cuda") < 0.3, 0.37),
                           K.scaled_masked_softmax, R.scaled_masked_softmax),
        "permute": (lambda: (_offset_tensor(rows, h, **mk), experts()), K.permute, R.permute),
        "unpermute": (unpermute_args, K.unpermute, R.unpermute),
    }


@pytest.mark.usefixtures("require_extension")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("h", [64, 4096, 12288, 65536])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_packed_cases(64, torch.float32, 0)))
def test_cuda_packed_paths_match_reference(name, dtype, h, offset, monkeypatch):
    """The CUDA kernels' 16-byte and one-element paths, at every register tier of the row kernels."""
    _check_fused(name, *_packed_cases(h, dtype, offset)[name], monkeypatch)


@pytest.mark.usefixtures("require_extension")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens, k, experts", [(1, 1, 1), (700, 2, 8), (5000, 8, 256), (3000, 2, 300), (40, 2, 1)])
def test_cuda_row_map_is_the_stable_argsort(tokens, k, experts):
    """The counting sort over tiles of 1,024 assignments (one tile, several, the last one partial, 256 experts: the
    most it sorts) and its argsort past that (300 experts), with a fifth of the assignments dropped (-1)."""
    torch.manual_seed(0)
    ids = torch.randint(0, experts, (tokens, k), device="cuda")
    ids[torch.rand(tokens, k, device="cuda") < 0.2] = -1
    assert torch.equal(torch.ops.megalite.permute_row_map(ids), R.permute_row_map(ids))
    assert torch.ops.megalite.permute_row_map(torch.full((5, 2), -1, device="cuda")).numel() == 0


@pytest.mark.usefixtures("require_extension")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_swiglu_rows_past_the_grid_walk_the_rows():
    """SwiGLU's grid holds at most 65,535 rows; its threads walk the rest (70,001 rows here), forward and
    backward against the reference in fp32."""
    torch.manual_seed(0)
    x, bias = torch.randn(70_001, 16, device="cuda", requires_grad=True), torch.randn(16, device="cuda")
    grad = torch.randn(70_001, 8, device="cuda")
    got = K.bias_swiglu(x, bias)
    want = R.bias_swiglu(x, bias)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0],
                               **TOL[torch.float32])


@pytest.mark.usefixtures("require_extension")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_permute_zeroes_the_rows_of_ignored_entries():
    """A row whose entry is outside [0, tokens * k) comes out as zeros (three of 600 rows); every other row is its
    assignment's token row."""
    tokens = torch.randn(300, 64, device="cuda")
    row_map = torch.arange(600, device="cuda").flip(0)
    ignored = torch.tensor([5, 299, 599], device="cuda")
    row_map[ignored] = torch.tensor([-1, 600, 10**6], device="cuda")
    want = tokens[row_map.clamp(0, 599) // 2]
    want[ignored] = 0
    assert torch.equal(torch.ops.megalite.permute_fwd(tokens, row_map, 2), want)


@pytest.mark.usefixtures("require_extension")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("h", [64, 4096])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_cuda_norm_backward_with_more_rows_than_slots(name, h):
    """The backward's row slots (at most 1024) each walk several rows, summing their weight gradients in
    registers.  Against the reference: the input gradient at the fp32 tolerance, the weight (and bias)
    gradients within 1e-5 of the sum of their terms' magnitudes (fp32 summation of 2,085 rows in another order
    stays well inside it; a row missed or counted twice moves it by about 1/2,085 of that sum)."""
    rows = 2 * 1024 + 37
    torch.manual_seed(0)
    x, grad = torch.randn(rows, h, device="cuda", requires_grad=True), torch.randn(rows, h, device="cuda")
    params = [torch.randn(h, device="cuda", requires_grad=True) for _ in range(2 if name == "layer_norm" else 1)]
    got = torch.autograd.grad(getattr(K, name)(x, *params, 1e-5), [x, *params], grad)
    want = torch.autograd.grad(getattr(R, name)(x, *params, 1e-5), [x, *params], grad)
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float32])
    x64 = x.detach().double()
    centred = x64 - x64.mean(-1, keepdim=True) if name == "layer_norm" else x64
    xhat = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
    magnitudes = [(grad.double() * xhat).abs().sum(0), grad.double().abs().sum(0)]
    for g, w, m in zip(got[1:], want[1:], magnitudes):
        assert ((g.double() - w.double()).abs() <= 1e-5 * m).all()


@pytest.mark.usefixtures("require_extension")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_rows_past_the_register_limit_use_the_reference(monkeypatch):
    h = fused.CUDA_MAX_ROW + 8
    x, weight = torch.randn(2, h, device="cuda"), torch.randn(h, device="cuda")
    monkeypatch.setattr(fused, "rms_norm", lambda *a: pytest.fail("the fused kernel got a row it cannot hold"))
    assert torch.equal(K.rms_norm(x, weight, 1e-6), R.rms_norm(x, weight, 1e-6))
    mask = torch.rand(1, 1, 1, h, device="cuda") < 0.5
    monkeypatch.setattr(fused, "scaled_masked_softmax", lambda *a: pytest.fail("the fused kernel got a long row"))
    assert torch.equal(K.scaled_masked_softmax(x[None, None], mask, 0.5), R.scaled_masked_softmax(x[None, None], mask, 0.5))
