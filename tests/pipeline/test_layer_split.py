import pytest

from megalite.pipeline import LayerLayout, split_flags_layout, split_layers


def _flatten_in_virtual_order(ranges):
    pp, vpp = len(ranges), len(ranges[0])
    return [ranges[v % pp][v // pp] for v in range(pp * vpp)]


def test_even_split():
    assert split_layers(8, 2) == [[(0, 4)], [(4, 8)]]
    assert split_layers(8, 4) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    assert split_layers(3, 1) == [[(0, 3)]]


def test_interleaved_chunks_follow_virtual_stage_order():
    assert split_layers(8, 2, vpp=2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    ranges = split_layers(24, 4, vpp=3)
    flat = _flatten_in_virtual_order(ranges)
    assert flat[0][0] == 0 and flat[-1][1] == 24
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
    assert all(end - start == 2 for start, end in flat)


def test_first_and_last_stage_overrides():
    assert split_layers(10, 4, first=1, last=3) == [[(0, 1)], [(1, 4)], [(4, 7)], [(7, 10)]]
    assert split_layers(7, 3, first=1) == [[(0, 1)], [(1, 4)], [(4, 7)]]
    assert split_layers(5, 2, first=2, last=3) == [[(0, 2)], [(2, 5)]]
    assert split_layers(12, 2, vpp=2, first=4) == [[(0, 2), (6, 8)], [(2, 6), (8, 12)]]
    assert split_layers(6, 3, first=0, last=0) == [[(0, 0)], [(0, 6)], [(6, 6)]]


def test_per_stage_layer_counts():
    """``stage_layers``: every stage's count in stage order (stage ``c * pp + r`` is chunk ``c`` of rank ``r``),
    uneven middle stages, uneven chunks and empty stages included."""
    assert split_layers(7, 4, stage_layers=[1, 3, 1, 2]) == [[(0, 1)], [(1, 4)], [(4, 5)], [(5, 7)]]
    assert split_layers(5, 2, vpp=2, stage_layers=[1, 1, 2, 1]) == [[(0, 1), (2, 4)], [(1, 2), (4, 5)]]
    assert split_layers(4, 2, vpp=2, stage_layers=[0, 2, 2, 0]) == [[(0, 0), (2, 4)], [(0, 2), (4, 4)]]
    assert split_layers(5, 2, vpp=2, v_shape=True, stage_layers=[1, 1, 2, 1]) == [[(0, 1), (4, 5)], [(1, 2), (2, 4)]]
    assert split_layers(3, 1, stage_layers=(3,)) == [[(0, 3)]]


@pytest.mark.parametrize("args, kwargs, message", [
    ((5, 2), {"vpp": 2, "stage_layers": [1, 1, 3]}, r"3 per-stage layer counts for 4 stages \(pp=2 x vpp=2\)"),
    ((5, 2), {"stage_layers": [1, 3]}, r"the per-stage layer counts \[1, 3\] sum to 4, not num_layers=5"),
    ((5, 2), {"stage_layers": [6, -1]}, "a stage's layer count must be a non-negative integer, got -1"),
    ((5, 2), {"first": 1, "stage_layers": [1, 4]}, "give either per-stage layer counts or first/last stage layer"),
    ((6, 4), {}, "num_layers=6 is not divisible by pipeline size pp=4"),
    ((8, 2), {"vpp": 3}, "stage 0 has 4 layers, not divisible by vpp=3"),
    ((10, 4), {"first": 2}, "the 8 layers left after first=2, last=None do not divide evenly over the other 3"),
    ((5, 2), {"first": 1, "last": 5}, "first=1 and last=5 pipeline-stage layers exceed num_layers=5"),
    ((5, 2), {"first": 1, "last": 3}, r"first=1 \+ last=3 layers != num_layers=5 with pp=2"),
    ((4, 1), {"first": 2}, "with one pipeline stage the first stage holds all 4 layers, got first=2"),
    ((4, 0), {}, "pp must be a positive integer, got 0"),
    ((4, 2), {"first": -1}, "first must be a non-negative integer, got -1"),
])
def test_bad_splits(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        split_layers(*args, **kwargs)


def test_split_flags_layout_picks_the_layout_then_the_counted_split():
    """One rule for which split flag decides the stages: the layout string first, else (pp > 1) the embedding
    and/or loss counted as a layer, else None (the even or first/last split)."""
    assert split_flags_layout(3, 2, layout="Et|ttL") == LayerLayout(None, (1, 2))
    assert split_flags_layout(3, 2, layout="Et|t|t|L", embedding=True) == LayerLayout(2, (1, 1, 1, 0))
    assert split_flags_layout(4, 2, vpp=3, embedding=True, loss=True) == LayerLayout(3, (0, 1, 1, 1, 1, 0))
    assert split_flags_layout(5, 2, loss=True) == LayerLayout(None, (3, 2))
    assert split_flags_layout(5, 1, embedding=True, loss=True) is None
    assert split_flags_layout(4, 2, vpp=2) is None
    with pytest.raises(ValueError, match=r"num_layers=4 \+ embedding = 5 layers do not split evenly"):
        split_flags_layout(4, 2, embedding=True)
