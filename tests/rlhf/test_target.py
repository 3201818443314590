"""Chunked Polyak averaging on CPU equals the whole-tensor formula for any chunk size, loads back into a module,
and holds exactly its tensors' bytes."""

import pytest
import torch

from megalite.rlhf import CriticModel
from megalite.rlhf.target import PolyakTarget
from tests.rlhf.common import config


def test_chunked_polyak_equals_formula_and_loads_back():
    source = CriticModel(config())
    expected = {n: p.detach().clone() for n, p in source.named_parameters()}
    targets = [PolyakTarget(source, tau=0.1, chunk_numel=c) for c in (7, 1000, 1 << 20)]
    for step in range(3):
        with torch.no_grad():
            for p in source.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        for target in targets:
            target.update(source)
        for name, p in source.named_parameters():
            expected[name] = expected[name] + 0.1 * (p.detach() - expected[name])
    for target in targets:
        for name, value in expected.items():
            torch.testing.assert_close(target.params[name], value, rtol=0, atol=1e-6)
            assert torch.equal(target.params[name], targets[0].params[name])
    scoring = CriticModel(config())
    targets[1].load_into(scoring)
    for name, p in scoring.named_parameters():
        assert torch.equal(p, targets[1].params[name])
    numel = sum(p.numel() for p in source.parameters())
    assert targets[1].resident_bytes() == 4 * (numel + 1000)
    with pytest.raises(ValueError, match="Polyak rate tau must be in \\(0, 1\\], got 1.5"):
        PolyakTarget(source, tau=1.5)
