"""Dropout's draw on CUDA (megalite.kernels.philox): Triton's Philox4x32-10 in the element layout the CUDA kernels
use.  The CUDA kernels themselves are held to it by the parity tests on a GPU (fused against reference under one
seed); here, on CPU, the reference's Triton kernel (in Triton's interpreter) against Philox written out from its
paper, which first meets Random123's known answers."""

import ast
import os
import subprocess
import sys

import pytest

from megalite.kernels import philox

MASK32 = 0xFFFFFFFF


def _philox(counter, key):
    """Philox4x32-10 of a counter (4 words) under a key (2 words), as Salmon et al. define it."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        a, b = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((b >> 32) ^ c1 ^ k0) & MASK32, b & MASK32, ((a >> 32) ^ c3 ^ k1) & MASK32, a & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def test_philox_meets_random123_known_answers():
    assert _philox((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert _philox((MASK32,) * 4, (MASK32, MASK32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert _philox((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_keep_threshold_is_one_minus_p_in_32_bits():
    assert philox.keep_threshold(0.25) == 3 * 2**30
    assert philox.keep_threshold(0.5) == 2**31
    assert philox.keep_threshold(1e-12) == 2**32 - 1  # rounds to 2^32, which a 32-bit word cannot stay below
    assert philox.keep_threshold(0.75) == 2**30


_DRAW = """
import torch
from megalite.kernels import philox
out = []
for seed, n, p in ((42, 4, 0.0), ({seed}, 4103, 0.3), ((1 << 40) + 12345, 9, 0.5)):
    mask = philox.keep_mask(torch.tensor(seed), (n,), philox.keep_threshold(p) if p else 2**32 - 1)
    out.append(mask.tolist())
print(out)
"""


def test_reference_keep_mask_is_philox_per_element():
    """Element e is kept when word e % 4 of the draw for counter (e // 4, 0, 0, 0) under key (seed low, seed high)
    is below the threshold: a whole draw, a tail of 3 elements past 1,025 draws, and a seed above 32 bits."""
    pytest.importorskip("triton")
    seed = 2**62 + 7
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _DRAW.format(seed=seed)], env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    got = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    cases = ((42, 4, 2**32 - 1), (seed, 4103, philox.keep_threshold(0.3)), ((1 << 40) + 12345, 9, 2**31))
    for mask, (key, n, threshold) in zip(got, cases):
        words = [_philox((e // 4, 0, 0, 0), (key & MASK32, key >> 32))[e % 4] for e in range(n)]
        assert mask == [w < threshold for w in words]
    assert got[0] == [True] * 4
    assert 0.27 < 1 - sum(got[1]) / 4103 < 0.33
