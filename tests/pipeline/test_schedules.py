"""Schedule parity against one rank, op orders, forward-only, activation memory, DDP hooks, bad input."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite import topology
from megalite.pipeline import PipelineRecorder, broadcast_from_last_stage, forward_backward, split_layers
from megalite.testing import run_distributed
from tests.pipeline import toy

TOL = 1e-5


def expected_1f1b(pp, rank, m):
    warmup = min(pp - rank - 1, m)
    order = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warmup, m)]


def expected_interleaved(pp, rank, m, vpp):
    """Megatron's order: micro-batches in groups of pp, each group through chunk 0, 1, ... (reversed for B)."""
    def op(kind, k):
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        return (kind, group * pp + k % pp, chunk if kind == "F" else vpp - 1 - chunk)

    total = m * vpp
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    order = [op("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [op("F", warmup + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warmup, total)]


class _LiveActivations:
    """Counts, via saved-tensor hooks, the micro-batches whose saved activations are alive."""

    def __init__(self):
        self.live = {}
        self.current = None
        self.peak = 0

    def pack(self, tensor):
        # Keep an alias, as autograd itself does, not the tensor object: the schedule swaps a sent
        # output's .data for a placeholder, which must not reach a saved copy of that output.
        return _Held(self, self.current, tensor.detach())

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    def __init__(self, counter, microbatch, tensor):
        self.counter, self.microbatch, self.tensor = counter, microbatch, tensor
        counter.live[microbatch] = counter.live.get(microbatch, 0) + 1
        counter.peak = max(counter.peak, len(counter.live))

    def __del__(self):
        live = self.counter.live
        live[self.microbatch] -= 1
        if not live[self.microbatch]:
            del live[self.microbatch]


class _SyncSpy(nn.Module):
    """A DDP-like wrapper that logs, per backward, whether gradient sync was enabled."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.syncing = True
        self.log = []

    def no_sync(self):
        spy = self

        class _Ctx:
            def __enter__(self):
                spy.syncing = False

            def __exit__(self, *exc):
                spy.syncing = True

        return _Ctx()

    def forward(self, x=None):
        return _Probe.apply(self.module(x), self)


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spy):
        ctx.spy = spy
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.spy.log.append(ctx.spy.syncing)
        return grad, None


def _run_toy(rank, pp, vpp, m, *, seq=3, tensor_shape=None, forward_only=False, memory=False, spy=False):
    chunks_per_rank = vpp or 1
    num_layers = 2 * pp * chunks_per_rank
    layers = toy.full_stack(num_layers)
    chunks = [toy.Chunk(layers, s, e) for s, e in split_layers(num_layers, pp, vpp)[rank]]
    if spy:
        chunks = [_SyncSpy(c) for c in chunks]
    batches = toy.microbatches(m, seq=seq)
    step = toy.make_forward_step(chunks[0] if rank == 0 else None, chunks[-1] if rank == pp - 1 else None)
    counter = _LiveActivations()
    sent = []

    def forward_step(data_iterator, chunk):
        counter.current = (counter.current or 0) + 1
        output, loss_func = step(data_iterator, chunk)
        if loss_func is None:
            sent.append(output)
        return output, loss_func

    finalized = []
    recorder = PipelineRecorder()
    iterators = [iter(batches) for _ in chunks]
    hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack) if memory else None
    if hooks:
        hooks.__enter__()
    metrics = forward_backward(forward_step, iterators if vpp else iterators[0], chunks if vpp else chunks[0], m,
                               tensor_shape=tensor_shape, forward_only=forward_only, recorder=recorder,
                               finalize_grads_func=lambda c: finalized.append([len(x.log) for x in c] if spy else len(c)))
    if hooks:
        hooks.__exit__(None, None, None)
    losses, outputs, grads = toy.reference(num_layers, batches)
    result = {"order": recorder.order(), "events": recorder.events, "stage": recorder.stage,
              "metrics": len(metrics), "peak_live": counter.peak, "finalized": finalized}
    if rank == pp - 1:
        result["loss_err"] = max(abs(mt["loss"].item() - ref) for mt, ref in zip(metrics, losses))
        result["out_err"] = max((mt["output"] - ref).abs().max().item() for mt, ref in zip(metrics, outputs))
    params = [p for c in chunks for p in c.parameters()]
    if forward_only:
        result["grads_none"] = all(p.grad is None for p in params)
    else:
        err = 0.0
        for chunk in chunks:
            inner = chunk.module if spy else chunk
            for i, layer in enumerate(inner.layers):
                ref_w, ref_b = grads[inner.start + i]
                err = max(err, (layer.weight.grad - ref_w).norm().item() / ref_w.norm().item(),
                          (layer.bias.grad - ref_b).norm().item() / ref_b.norm().item())
        result["grad_err"] = err
        result["freed"] = all(t.untyped_storage().nbytes() <= t.element_size() for t in sent)
        result["sync_log"] = [c.log for c in chunks] if spy else None
    all_losses = broadcast_from_last_stage([mt["loss"] for mt in metrics])
    result["broadcast"] = [float(x) for x in all_losses]
    result["ref_losses"] = losses
    return result


CASES = {
    2: [(None, 1, {}), (None, 2, {}), (None, 5, {"memory": True, "spy": True}),
        (None, 4, {"tensor_shape": (3, 2, toy.HIDDEN)}), (None, 3, {"seq": 5}),
        (None, 3, {"forward_only": True}),
        (2, 2, {}), (2, 4, {"spy": True}), (3, 2, {}), (2, 6, {"seq": 4}), (2, 4, {"forward_only": True})],
    4: [(None, 1, {}), (None, 3, {}), (None, 9, {"memory": True}), (None, 4, {"spy": True}),
        (None, 5, {"forward_only": True}),
        (2, 4, {}), (2, 8, {"spy": True}), (3, 4, {}), (2, 8, {"forward_only": True})],
}


def _toy_suite(pp):
    rank = topology.initialize(pp=pp).pp.rank
    return [_run_toy(rank, pp, vpp, m, **kw) for vpp, m, kw in CASES[pp]]


def _check_dependencies(per_rank, pp):
    """Across ranks: F(mb, v) follows F(mb, v-1); B(mb, v) follows B(mb, v+1) and F(mb, v)."""
    span = {}
    for r in per_rank:
        for kind, mb, chunk, start, end in r["events"]:
            span[(kind, mb, chunk * pp + r["stage"])] = (start, end)
    for (kind, mb, v), (start, _) in span.items():
        before = [("F", mb, v - 1)] if kind == "F" else [("B", mb, v + 1), ("F", mb, v)]
        for dep in before:
            if dep in span:
                assert span[dep][1] <= start, (kind, mb, v, dep)


@pytest.mark.parametrize("pp", [2, 4])
def test_toy_schedules_match_single_rank(pp):
    results = run_distributed(_toy_suite, pp, pp, timeout=180)
    for index, (vpp, m, kw) in enumerate(CASES[pp]):
        case = (vpp, m, kw)
        per_rank = [results[rank][index] for rank in range(pp)]
        for rank, r in enumerate(per_rank):
            assert r["stage"] == rank
            if vpp is None:
                want = expected_1f1b(pp, rank, m)
            else:
                want = expected_interleaved(pp, rank, m, vpp)
            if kw.get("forward_only"):
                want = [op for op in want if op[0] == "F"]
                assert r["grads_none"], case
                assert r["finalized"] == [], case
            else:
                assert r["grad_err"] <= TOL, (case, rank, r["grad_err"])
                assert r["freed"], case
                assert len(r["finalized"]) == 1, case
            assert r["order"] == want, (case, rank)
            assert r["broadcast"] == pytest.approx(r["ref_losses"], rel=TOL), case
            if kw.get("memory"):
                assert r["peak_live"] == min(pp - rank, m) <= pp, (case, rank, r["peak_live"])
            if kw.get("spy") and not kw.get("forward_only"):
                for log in r["sync_log"]:
                    assert log == [False] * (m - 1) + [True], (case, rank, log)
                assert r["finalized"] == [[m] * (vpp or 1)], case
        last = per_rank[-1]
        assert last["metrics"] == m and all(r["metrics"] == 0 for r in per_rank[:-1]), case
        assert last["loss_err"] <= TOL and last["out_err"] <= TOL, case
        _check_dependencies(per_rank, pp)


def test_orders_match_hand_written_examples():
    assert expected_1f1b(4, 1, 4) == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("F", 3, 0),
                                      ("B", 1, 0), ("B", 2, 0), ("B", 3, 0)]
    assert expected_interleaved(2, 0, 4, 2) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1),
        ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0), ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]


def test_no_pipelining_is_gradient_accumulation():
    num_layers, m = 3, 4
    layers = toy.full_stack(num_layers)
    chunk = toy.Chunk(layers, 0, num_layers)
    batches = toy.microbatches(m)
    recorder = PipelineRecorder()
    scale = 8.0
    metrics = forward_backward(toy.make_forward_step(chunk, chunk), iter(batches), chunk, m, recorder=recorder,
                               scale_loss=lambda loss: loss * scale)
    losses, _, grads = toy.reference(num_layers, batches)
    assert [mt["loss"].item() for mt in metrics] == pytest.approx(losses, rel=TOL)
    for i, layer in enumerate(chunk.layers):
        torch.testing.assert_close(layer.weight.grad / scale, grads[i][0], rtol=TOL, atol=TOL)
        torch.testing.assert_close(layer.bias.grad / scale, grads[i][1], rtol=TOL, atol=TOL)
    assert recorder.order() == [(k, i, 0) for i in range(m) for k in "FB"]
    assert recorder.stage == 0


def _bad_inputs():
    topology.initialize(pp=2)
    layers = toy.full_stack(4)
    chunks = [toy.Chunk(layers, 2 * i, 2 * i + 1) for i in range(2)]
    step = toy.make_forward_step(None, None)
    messages = []
    attempts = [
        lambda: forward_backward(step, [iter([])] * 2, chunks, 3),
        lambda: forward_backward(step, [iter([])] * 3, chunks, 4),
        lambda: forward_backward(step, iter([]), chunks, 4),
        lambda: forward_backward(step, iter([]), chunks[0], 0),
        lambda: forward_backward(step, [iter([])] * 2, [nn.Linear(2, 2), nn.Linear(2, 2)], 4),
    ]
    for attempt in attempts:
        try:
            attempt()
        except ValueError as err:
            messages.append(str(err))
    dist.barrier()
    return messages


def test_bad_input_raises_before_any_send():
    for messages in run_distributed(_bad_inputs, 2, timeout=60):
        assert messages == [
            "the interleaved schedule needs num_microbatches divisible by pp: 3 micro-batches, pp=2",
            "got 3 data iterators for 2 model chunks",
            "interleaving over 2 model chunks needs a list of 2 data iterators",
            "num_microbatches must be a positive integer, got 0",
            messages[4],
        ]
        assert "has no set_input_tensor()" in messages[4]


def test_chunks_without_pipeline_are_rejected():
    chunk = toy.Chunk(toy.full_stack(2), 0, 2)
    with pytest.raises(ValueError, match="2 model chunks need a pipeline of more than one stage, got pp=1"):
        forward_backward(toy.make_forward_step(chunk, chunk), [iter([]), iter([])], [chunk, chunk], 2)
