import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite import tensor_parallel as tpl
from megalite.testing import run_distributed

from ._blocks import ParallelAttention


def _expect(call, *needles):
    with pytest.raises(ValueError) as info:
        call()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def _bad_input():
    topology.initialize(tp=4)
    group = topology.current().tp.group
    _expect(lambda: tpl.ColumnParallelLinear(8, 6), "out_features=6", "size 4")
    _expect(lambda: tpl.RowParallelLinear(10, 8), "in_features=10", "size 4")
    _expect(lambda: tpl.VocabParallelEmbedding(30, 8), "num_embeddings=30", "size 4")
    _expect(lambda: ParallelAttention(16, 6, 6, group), "num_heads=6", "size 4")
    _expect(lambda: tpl.RowParallelLinear(8, 8, sequence_parallel=True, input_is_parallel=False),
            "sequence_parallel", "input_is_parallel")
    _expect(lambda: tpl.ColumnParallelLinear(8, 8, sequence_parallel=True, gather_output=True),
            "gather_output", "sequence_parallel")
    _expect(lambda: tpl.scatter_to_tensor_parallel_region(torch.zeros(2, 6)), "size 6", "size 4")
    _expect(lambda: tpl.reduce_scatter_to_sequence_parallel_region(torch.zeros(6, 2)), "size 6", "size 4")
    _expect(lambda: tpl.vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long)),
            "(2,)", "(3, 4)")
    _expect(lambda: tpl.vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), 1.5),
            "1.5")
    dist.barrier()  # no rank tears down its groups while another is still connecting them
    return True


def test_bad_sizes_raise_before_any_collective():
    assert run_distributed(_bad_input, 4, timeout=180) == [True] * 4
