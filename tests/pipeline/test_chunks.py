"""The one stage map and the one chunk builder: stages, layer ranges and first/last flags per schedule."""

import pytest

from megalite import topology
from megalite.pipeline import StageMap, build_chunks, last_stage_rank
from megalite.testing import run_distributed


@pytest.mark.parametrize("pp, chunks, v_shape", [(1, 1, False), (4, 1, False), (2, 3, False), (4, 2, True)])
def test_stage_map_is_a_bijection_and_its_inverse(pp, chunks, v_shape):
    stages = StageMap(pp, chunks, v_shape)
    seen = sorted(stages.stage(r, c) for r in range(pp) for c in range(chunks))
    assert seen == list(range(pp * chunks))
    for r in range(pp):
        for c in range(chunks):
            assert stages.place(stages.stage(r, c)) == (r, c)


def test_stage_map_interleaves_and_folds_the_v():
    assert [StageMap(2, 2).stage(r, c) for r, c in ((0, 0), (1, 0), (0, 1), (1, 1))] == [0, 1, 2, 3]
    v = StageMap(3, 2, v_shape=True)
    assert [v.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert v.is_first(0, 0) and v.is_last(0, 1) and not v.is_last(2, 1)
    assert StageMap.for_schedule("zbv", 3) == v
    assert (last_stage_rank(4, "zbv"), last_stage_rank(4, "1f1b"), last_stage_rank(4, "interleaved-1f1b")) == (0, 3, 3)
    with pytest.raises(ValueError, match="a V-shaped layout has 2 model chunks per pipeline rank, got 3"):
        StageMap(2, 3, v_shape=True)


def _record(**where):
    return where


def _built(cases):
    topo = topology.initialize(pp=2)
    return {name: build_chunks(_record, layers, topo.pp.group, **kwargs) for name, (layers, kwargs) in cases.items()}


CASES = {"1f1b": (4, {}),
         "uneven": (5, {"first_stage_layers": 2}),
         "interleaved": (8, {"vpp": 2, "schedule": "interleaved-1f1b"}),
         "zbv": (8, {"schedule": "zbv"})}


def test_build_chunks_for_1f1b_interleaved_and_zbv():
    rank0, rank1 = run_distributed(_built, 2, CASES)

    def chunk(layer_range, first=False, last=False):
        return {"pre_process": first, "post_process": last, "layer_range": layer_range}

    assert rank0["1f1b"] == [chunk((0, 2), first=True)]
    assert rank1["1f1b"] == [chunk((2, 4), last=True)]
    assert rank0["uneven"] == [chunk((0, 2), first=True)]
    assert rank1["uneven"] == [chunk((2, 5), last=True)]
    # Interleaved: stages 0..3 are (rank 0, chunk 0), (1, 0), (0, 1), (1, 1).
    assert rank0["interleaved"] == [chunk((0, 2), first=True), chunk((4, 6))]
    assert rank1["interleaved"] == [chunk((2, 4)), chunk((6, 8), last=True)]
    # zbv: stages go down and back up, so rank 0 holds the first and the last stage.
    assert rank0["zbv"] == [chunk((0, 2), first=True), chunk((6, 8), last=True)]
    assert rank1["zbv"] == [chunk((2, 4)), chunk((4, 6))]


def test_build_chunks_without_a_pipeline_is_one_whole_chunk():
    assert build_chunks(_record, 3, None) == [{"pre_process": True, "post_process": True, "layer_range": (0, 3)}]
