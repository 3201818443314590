"""``MoEConfig.shared_expert_overlap``: the shared expert runs while the dispatch's token all-to-all is in flight.

The overlapped layer must give bitwise the same outputs and gradients as the plain one (the same ops, only
issued in another order), and the recorded order of events must show the overlap: the all-to-alls issued
asynchronously, the shared expert run, then the wait, in forward and in backward.
"""

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.models.config import GPTConfig
from megalite.models.mlp import MLP
from megalite.moe import MoEConfig, MoELayer
from megalite.testing import run_distributed

S, B, H = 8, 2, 16


def _layer(overlap: bool, sequence_parallel: bool = False) -> MoELayer:
    """A swiglu MoE layer with a gated shared expert (biases on), the same weights for either schedule."""
    model = GPTConfig(vocab_size=64, num_layers=2, hidden_size=H, num_attention_heads=2, activation="swiglu",
                      init_method_std=0.5)
    config = MoEConfig(num_experts=4, ffn_hidden_size=8, topk=2, activation="swiglu", add_bias=True,
                       aux_loss_coeff=0.01, z_loss_coeff=0.001, shared_expert_intermediate_size=12,
                       shared_expert_gate=True, shared_expert_overlap=overlap, init_method_std=0.5)
    torch.manual_seed(7)
    shared = MLP(model, sequence_parallel=sequence_parallel, ffn_hidden_size=12)
    layer = MoELayer(H, config, sequence_parallel=sequence_parallel, shared_experts=shared)
    with torch.no_grad():
        for param in layer.parameters():
            if param.abs().sum() == 0:  # zero-initialised biases: make one added twice or lost show up
                param.normal_()
    return layer


def _run(layer: MoELayer, rows: slice):
    gen = torch.Generator().manual_seed(1234 + topology.current().dp.rank)
    x = torch.randn(S, B, H, generator=gen)[rows].requires_grad_(True)
    g = torch.randn(S, B, H, generator=gen)[rows]
    out = layer(x)
    (out * g).sum().backward()
    return [out, x.grad] + [p.grad for p in layer.parameters()]


def _record_events(layer: MoELayer, events: list) -> None:
    """Log every all-to-all as issued ("issue async" / "blocking") and its wait, and the shared expert's forward
    and backward, in the order they happen."""
    original = dist.all_to_all_single

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def all_to_all_single(*args, async_op=False, **kwargs):
        events.append("issue async" if async_op else "blocking")
        work = original(*args, async_op=async_op, **kwargs)
        return Work(work) if async_op else work

    dist.all_to_all_single = all_to_all_single
    shared = layer.shared_experts
    shared.register_forward_pre_hook(lambda *_: events.append("shared forward"))
    shared.register_forward_hook(lambda *_: events.append("shared forward done"))
    shared.register_full_backward_pre_hook(lambda *_: events.append("shared backward"))
    shared.register_full_backward_hook(lambda *_: events.append("shared backward done"))
    layer.register_forward_hook(lambda *_: events.append("forward done"))


def _compare_schedules(layout: dict, sequence_parallel: bool):
    topo = topology.initialize(**layout)
    rows = slice(None)
    if sequence_parallel:
        block = S // topo.tp.size
        rows = slice(topo.tp.rank * block, (topo.tp.rank + 1) * block)
    plain = _run(_layer(False, sequence_parallel), rows)
    overlapped_layer = _layer(True, sequence_parallel)
    events = []
    _record_events(overlapped_layer, events)
    overlapped = _run(overlapped_layer, rows)
    equal = [torch.equal(a, b) for a, b in zip(plain, overlapped)]
    return equal, len(plain), events


def _check(per_rank):
    for rank, (equal, count, events) in enumerate(per_rank):
        assert count > 10 and len(equal) == count and all(equal), f"rank {rank}: bitwise equal per tensor {equal}"
        assert events.count("forward done") == 1, f"rank {rank}: {events}"
        forward_end = events.index("forward done")
        forward, backward = events[:forward_end], events[forward_end + 1:]
        # Forward: the rows, expert ids and gates issued without waiting, the shared expert, then the waits.
        shared = forward.index("shared forward")
        assert forward[shared - 3:shared + 5] == ["issue async"] * 3 + ["shared forward", "shared forward done"] + [
            "wait"] * 3, f"rank {rank}: {forward}"
        assert forward.count("issue async") == 3 and forward.count("wait") == 3, f"rank {rank}: {forward}"
        # Backward: the gradients of the rows and gates sent back, the shared expert's whole backward, then the
        # waits.
        shared = backward.index("shared backward")
        assert backward[shared - 2:shared + 4] == ["issue async"] * 2 + ["shared backward", "shared backward done"] + [
            "wait"] * 2, f"rank {rank}: {backward}"
        assert backward.count("issue async") == 2 and backward.count("wait") == 2, f"rank {rank}: {backward}"


def test_ep2_overlap_is_bitwise_the_same_and_overlaps():
    _check(run_distributed(_compare_schedules, 2, dict(ep=2), False, timeout=120))


def test_tp2_ep2_sequence_parallel_overlap_is_bitwise_the_same_and_overlaps():
    _check(run_distributed(_compare_schedules, 4, dict(tp=2, ep=2), True, timeout=180))


@pytest.mark.parametrize("overrides", [dict(), dict(shared_expert_intermediate_size=8, dispatcher="allgather")])
def test_overlap_needs_a_shared_expert_and_the_alltoall_dispatcher(overrides):
    config = MoEConfig(num_experts=4, ffn_hidden_size=8, shared_expert_overlap=True, **overrides)
    with pytest.raises(ValueError, match="shared_expert_overlap needs a shared expert .* and the alltoall dispatcher"):
        config.validate()


def test_the_flag_sets_the_config():
    from megalite.training.flags import gpt_config, parse_args

    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--vocab-size", "64",
            "--num-experts", "4", "--moe-shared-expert-intermediate-size", "8"]
    assert gpt_config(parse_args(base + ["--moe-shared-expert-overlap"])).moe.shared_expert_overlap
    assert not gpt_config(parse_args(base)).moe.shared_expert_overlap
