"""Predicted activation bytes per micro-batch are within 10% of what autograd saves, per recompute option.

The measurement packs every tensor autograd saves during one training forward (not the
recomputation in backward) (saved-tensor hooks),
counts each storage once and leaves out the parameters: the bytes backward needs from this
micro-batch.  Six layouts cover none / selective / full recompute, tp = 1 and 2, sequence
parallelism, GELU and SwiGLU, learned and rotary positions, dropout.
"""

from __future__ import annotations

import pytest

from megalite.testing import run_distributed

SEQ, MICRO = 32, 2
# (tp, sequence parallel, recompute, activation, position embedding, hidden dropout)
LAYOUTS = [
    (1, False, None, "gelu", "learned_absolute", 0.1),
    (1, False, "selective", "swiglu", "rope", 0.0),
    (1, False, "full", "gelu", "rope", 0.0),
    (2, False, None, "gelu", "rope", 0.0),
    (2, True, "selective", "swiglu", "rope", 0.0),
    (2, True, "full", "gelu", "learned_absolute", 0.1),
]


def _measure(layouts):
    import torch

    from megalite import topology
    from megalite.models import GPTConfig, GPTModel
    from megalite.plan.activations import microbatch_activation_bytes
    from megalite.plan.layout import Layout
    from megalite.tensor_parallel import model_parallel_seed

    out = []
    for tp, sp, recompute, activation, positions, dropout in layouts:
        topo = topology.initialize(tp=tp)
        model_parallel_seed(1234, topo.tp.rank)
        config = GPTConfig(vocab_size=128, num_layers=2, hidden_size=64, num_attention_heads=4,
                           max_position_embeddings=SEQ, activation=activation, position_embedding_type=positions,
                           recompute_granularity=recompute, hidden_dropout=dropout)
        model = GPTModel(config, sequence_parallel=sp)
        model.train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved.setdefault(storage.data_ptr(), storage.nbytes())
            return tensor

        ids = torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(ids, ids).sum()
        loss.backward()
        layout = Layout(tp=tp, dp=2 // tp, sequence_parallel=sp, micro_batch_size=MICRO, recompute=recompute)
        out.append((sum(saved.values()), microbatch_activation_bytes(config, layout, SEQ)))
    return out


@pytest.mark.slow
def test_predicted_activation_bytes_within_ten_percent_of_saved_tensors():
    measured_rank0 = run_distributed(_measure, 2, LAYOUTS, timeout=240)[0]
    for layout, (measured, predicted) in zip(LAYOUTS, measured_rank0):
        assert measured > 0
        assert abs(predicted - measured) <= 0.10 * measured, (layout, measured, predicted)


def test_microbatches_in_flight_follow_each_schedules_warm_up():
    from megalite.plan.activations import microbatches_in_flight
    from megalite.plan.layout import Layout

    def per_rank(schedule, vpp, m):
        layout = Layout(pp=4, schedule=schedule, vpp=vpp)
        return [microbatches_in_flight(layout, m, rank) for rank in range(4)]

    # 1F1B and ZB-H1: warm-up pp - rank - 1 forwards, then one more before the first backward.
    assert per_rank(None, None, 8) == [4, 3, 2, 1]
    assert per_rank("zero-bubble-h1", None, 8) == [4, 3, 2, 1]
    assert per_rank(None, None, 2) == [2, 2, 2, 1]
    # Interleaved (vpp 2): (pp - rank - 1) * 2 + pp chunk forwards + 1, over 2 chunks; all of them when m == pp.
    assert per_rank("interleaved-1f1b", 2, 8) == [5.5, 4.5, 3.5, 2.5]
    assert per_rank("interleaved-1f1b", 2, 4) == [4, 4, 4, 4]
    # ZBV: two chunks per rank in a V; rank 0 holds the first and the last stage.
    assert per_rank("zbv", None, 8) == [4, 4, 4, 4]


def test_torchtitan_op_recompute_matches_torch_selective_checkpointing():
    """``torchtitan-op``'s bytes and recomputed FLOPs equal what torch's selective checkpointing keeps and reruns
    for a plain Llama block (wq wk wv wo, SDPA, w1 w3 w2) under the policy torchtitan's option states: save
    attention's outputs and every odd-numbered matmul's, recompute the rest (RNG state not kept, as there)."""
    import gc
    from collections import defaultdict

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    from torch.utils.flop_counter import FlopCounterMode

    from megalite.models import GPTConfig
    from megalite.plan.activations import TORCHTITAN_OP, layer_activation_bytes, op_recompute_flops_per_token
    from megalite.plan.layout import Layout

    h, heads, groups, ffn, batch, seq = 64, 4, 2, 96, 2, 32
    d = h // heads
    config = GPTConfig(vocab_size=128, num_layers=2, hidden_size=h, num_attention_heads=heads,
                       num_query_groups=groups, ffn_hidden_size=ffn, activation="swiglu", normalization="RMSNorm",
                       position_embedding_type="rope", max_position_embeddings=seq)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = nn.ModuleList([nn.RMSNorm(h), nn.RMSNorm(h)])
            self.wq, self.wk, self.wv = (nn.Linear(h, n * d, bias=False) for n in (heads, groups, groups))
            self.wo = nn.Linear(heads * d, h, bias=False)
            self.w1, self.w3, self.w2 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False), \
                nn.Linear(ffn, h, bias=False)

        def forward(self, x):
            y = self.norms[0](x)
            q, k, v = (t.view(batch, seq, -1, d).transpose(1, 2) for t in (self.wq(y), self.wk(y), self.wv(y)))
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(attention.transpose(1, 2).reshape(batch, seq, -1))
            y = self.norms[1](x)
            return x + self.w2(F.silu(self.w1(y)) * self.w3(y))

    attention_ops = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    def context():
        matmuls = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            if func == torch.ops.aten.mm.default:
                matmuls[ctx.is_recompute] += 1
                save = matmuls[ctx.is_recompute] % 2 == 1
            else:
                save = func in attention_ops
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(config.num_layers)])

    def forward(x, selective):
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=context, preserve_rng_state=False) \
                if selective else block(x)
        return x

    def live_storages():
        # Plain tensors and parameters only, by exact type: gc also lists what other tests left behind, such as
        # dead weakref proxies (isinstance on one raises) and fake tensors (no data pointer).
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in gc.get_objects() if type(t) in (torch.Tensor, nn.Parameter)}

    x = torch.randn(batch, seq, h, requires_grad=True)
    before = live_storages()
    out = forward(x, True)
    gc.collect()
    kept = {ptr: n for ptr, n in live_storages().items()
            if ptr not in before and ptr != out.untyped_storage().data_ptr()}
    # Every block keeps its input: the first block's is x, alive before the forward.
    measured = sum(kept.values()) + x.numel() * x.element_size()
    layout = Layout(micro_batch_size=batch, recompute=TORCHTITAN_OP)
    assert measured > 0
    assert measured == config.num_layers * layer_activation_bytes(config, layout, seq, 0, TORCHTITAN_OP)
    out.sum().backward()

    flops = []
    for selective in (False, True):
        with FlopCounterMode(display=False) as counter:
            forward(x, selective).sum().backward()
        flops.append(counter.get_total_flops())
    assert flops[1] - flops[0] == op_recompute_flops_per_token(config) * batch * seq > 0


def test_gpu_profiles_price_no_dropout_masks():
    """megalite's CUDA dropout draws its mask again in the backward (megalite/kernels/philox.py), so a GPU profile's
    layer keeps no mask; the calibrated CPU's kernels keep one byte an element, as torch's dropout does for another
    system's ops.  The difference is exactly the layers' two masks."""
    from megalite.hardware import load_hardware
    from megalite.models import GPTConfig
    from megalite.plan.activations import keeps_dropout_masks, microbatch_activation_bytes
    from megalite.plan.eager import TORCHTITAN_EAGER
    from megalite.plan.estimate import estimate
    from megalite.plan.layout import Layout

    gpu, cpu = load_hardware("h100"), load_hardware("cpu")
    assert not keeps_dropout_masks(gpu) and keeps_dropout_masks(cpu) and keeps_dropout_masks(gpu, TORCHTITAN_EAGER)
    config = GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=512, max_position_embeddings=64,
                       hidden_dropout=0.1)
    layout = Layout(tp=2, sequence_parallel=True, micro_batch_size=2)
    masks = 4 * 2 * (2 * 64 // 2) * 256  # layers x two masks x the rank's sequence-parallel tokens x h, a byte each
    assert microbatch_activation_bytes(config, layout, 64) - microbatch_activation_bytes(
        config, layout, 64, dropout_masks=False) == masks
    on_gpu, on_cpu = (estimate(config, layout, hw, 64, 8).memory for hw in (gpu, cpu))
    assert on_gpu["microbatches_in_flight"] == 1 and on_cpu["activations"] - on_gpu["activations"] == masks
