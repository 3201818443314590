import itertools
import os
import subprocess
import sys
import time

import pytest

from megalite import topology
from megalite.testing import run_distributed
from megalite.topology import rank_groups
from tests.leftover_processes import running


def test_worked_example():
    g = rank_groups(16, tp=2, pp=2)
    assert g["tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["pp"] == [[i, i + 8] for i in range(8)]
    assert g["embedding"] == g["pp"]
    assert g["model"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert g["cp"] == [[r] for r in range(16)]


def test_single_stage_embedding_is_one_rank():
    g = rank_groups(4, tp=2)
    assert g["embedding"] == [[0], [1], [2], [3]]


def test_expert_folding():
    g = rank_groups(8, tp=2, ep=4)
    assert g["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["expert_tp"] == g["tp"]
    assert g["expert_dp"] == [[r] for r in range(8)]
    g = rank_groups(8, tp=2, ep=2, etp=1)
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert_dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _layouts():
    for world in (1, 2, 4, 6, 8, 12, 16, 32):
        for tp, pp, cp, ep in itertools.product((1, 2, 4), (1, 2, 4), (1, 2), (1, 2, 4)):
            if world % (tp * pp * cp) or world % (tp * ep * pp):
                continue
            for order in ("tp-cp-ep-dp-pp", "tp-dp-cp-ep-pp", "tp-pp-dp-cp-ep"):
                yield world, tp, pp, cp, ep, order


def test_properties_over_layouts():
    count = 0
    for world, tp, pp, cp, ep, order in _layouts():
        g = rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
        dp = world // (tp * pp * cp)
        expected = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "model": tp * pp, "ep": ep,
                    "expert_tp": tp, "expert_dp": world // (tp * ep * pp)}
        for axis, size in expected.items():
            flat = sorted(r for group in g[axis] for r in group)
            assert flat == list(range(world)), (axis, world, tp, pp, cp, ep, order)
            assert all(len(group) == size for group in g[axis]), (axis, size)
        for t in g["tp"]:
            for d in g["dp"]:
                assert len(set(t) & set(d)) <= 1
        for t in g["tp"]:
            for p in g["pp"]:
                assert len(set(t) & set(p)) <= 1
        count += 1
    assert count > 100


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), "6 is not divisible by tp*pp*cp = 4*1*1 = 4"),
    (dict(world_size=8, tp=2, ep=3), "etp*ep*pp = 2*3*1 = 6"),
    (dict(world_size=8, order="tp-xx-dp-pp"), "unknown axis 'xx'"),
    (dict(world_size=8, order="tp-dp-dp-pp"), "'dp' appears more than once"),
    (dict(world_size=8, tp=2, order="dp-pp"), "lacks axis 'tp', whose size is 2"),
    (dict(world_size=8, tp=0), "tp must be a positive integer, got 0"),
])
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        rank_groups(**kwargs)


@pytest.mark.slow
def test_cli_prints_groups_and_fails_cleanly():
    ok = subprocess.run([sys.executable, "-m", "megalite.topology", "--world-size", "16",
                         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "[0, 2, 4, 6]" in ok.stdout and "[7, 15]" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "megalite.topology", "--world-size", "6",
                          "--tensor-model-parallel-size", "4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: world size 6 is not divisible by tp*pp*cp = 4*1*1 = 4"]


def _all_reduce_each_axis():
    import torch
    import torch.distributed as dist

    topo = topology.initialize(tp=2, pp=2, vpp=2, ep=2)
    me = dist.get_rank()
    expected = rank_groups(8, tp=2, pp=2, ep=2)
    sums = {}
    for axis in ("tp", "pp", "dp", "cp", "model", "embedding", "ep", "expert_tp", "expert_dp"):
        a = getattr(topo, axis)
        ranks = next(g for g in expected[axis] if me in g)
        assert (a.ranks, a.rank, a.size) == (ranks, ranks.index(me), len(ranks)), axis
        assert dist.get_world_size(a.group) == len(ranks), axis
        t = torch.tensor([float(me)])
        dist.all_reduce(t, group=a.group)
        sums[axis] = (t.item(), float(sum(ranks)))
    stage, peers = me // 4, [me % 4, me % 4 + 4]
    assert (topo.next_rank, topo.prev_rank) == (peers[1 - stage], peers[1 - stage])
    assert topo.is_first_stage() == (stage == 0) and topo.is_last_stage() == (stage == 1)
    topo.virtual_stage = 1
    assert not topo.is_first_stage(ignore_virtual=False)
    assert topo.is_last_stage(ignore_virtual=False) == (stage == 1)
    on_gpu = dist.get_backend() == "nccl"
    assert topology.device() == (torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"))
    return sums


def test_groups_communicate_on_8_ranks():
    for sums in run_distributed(_all_reduce_each_axis, 8):
        for axis, (got, want) in sums.items():
            assert got == want, axis


def test_device_without_a_process_group_is_the_cpu():
    import torch

    assert topology.device() == torch.device("cpu")


def _rank_fails():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()


def _start_a_child(path):
    """Start a process that outlives this rank unless the harness stops it (as a Megatron-Core save's Manager server
    process outlived a rank killed while it exited); its pid in ``path/<rank>``."""
    import torch.distributed as dist

    child = subprocess.Popen(["sleep", "60"])
    with open(os.path.join(path, str(dist.get_rank())), "w") as f:
        f.write(str(child.pid))


def _rank_hangs(path):
    import torch.distributed as dist

    _start_a_child(path)
    if dist.get_rank() == 0:
        time.sleep(60)


def _assert_children_stopped(path, ranks):
    """The children that :func:`_start_a_child` started on ``ranks`` are gone (or dead, not yet reaped)."""
    pids = [int(open(os.path.join(path, str(rank))).read()) for rank in range(ranks)]
    deadline = time.monotonic() + 10
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, pids)), pids


def test_harness_reports_failing_rank():
    with pytest.raises(AssertionError, match="(?s)rank 1.*boom on rank one"):
        run_distributed(_rank_fails, 2, timeout=30)


def _imported(name):
    return name in sys.modules


def test_ranks_start_with_what_the_conftest_preloads():
    """tests/conftest.py has the fork server import megalite.rlhf.trainer (this module does not), so a rank
    starts with it imported instead of importing it again."""
    assert run_distributed(_imported, 1, "megalite.rlhf.trainer") == [True]


def test_harness_kills_hanging_ranks(tmp_path):
    """Hung ranks are killed with what they started."""
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] did not finish and were killed after the 3s timeout"):
        run_distributed(_rank_hangs, 2, str(tmp_path), timeout=3)
    _assert_children_stopped(tmp_path, 2)


def test_what_a_rank_starts_ends_with_the_run(tmp_path):
    """A run leaves no process behind: what a rank started and left running is stopped when the rank is done."""
    run_distributed(_start_a_child, 2, str(tmp_path), timeout=30)
    _assert_children_stopped(tmp_path, 2)


def _bad_layout():
    topology.initialize(tp=3)


def test_initialize_rejects_bad_layout_on_every_rank():
    with pytest.raises(AssertionError, match="(?s)rank 0.*not divisible by tp.*rank 1"):
        run_distributed(_bad_layout, 2, timeout=30)
