"""The planner's weights / gradients / optimizer bytes equal what the trainer allocates, on every rank.

Each layout is built the way ``pretrain`` builds it (``build_model`` + ``build_optimizer`` from the
flags), one optimizer step creates AdamW's state, and every distinct tensor storage a rank holds is
summed: parameters as weights, ``main_grad`` buffers as gradients, the optimizer's main copies, their
gradients and its state as optimizer.  The prediction must match to the byte.
"""

from __future__ import annotations

import pytest

from megalite.testing import run_distributed

WORLD = 4
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "100",
         "--seq-length", "16", "--max-position-embeddings", "16", "--global-batch-size", "8"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2"]
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "8", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"]

# (name, extra flags, DDP bucket size override or None)
LAYOUTS = [
    ("dp4", [], None),
    ("dp4-bf16", ["--bf16"], None),
    ("dp4-zero1-bf16", ["--bf16", "--use-distributed-optimizer"], None),
    ("dp4-zero1-fp16-buckets", ["--fp16", "--use-distributed-optimizer"], 700),
    ("dp4-zero1-fp32-buckets-untied", ["--use-distributed-optimizer", "--untie-embeddings-and-output-weights"], 300),
    ("tp2-dp2", ["--tensor-model-parallel-size", "2"], None),
    ("tp2-sp-zero1-bf16", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
                           "--use-distributed-optimizer"], None),
    ("tp4-untied", ["--tensor-model-parallel-size", "4", "--untie-embeddings-and-output-weights"], None),
    ("pp2-tied", ["--pipeline-model-parallel-size", "2"], None),
    ("pp2-tied-zero1-bf16", ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"], 500),
    ("pp2-vpp2-tp2", ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                      "--tensor-model-parallel-size", "2"], None),
    ("pp2-uneven-zero1", ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
                          "--use-distributed-optimizer"], None),
    ("pp2-zbv-untied", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                        "--untie-embeddings-and-output-weights"], None),
    ("cp2-zero1-llama", ["--context-parallel-size", "2", "--use-distributed-optimizer"] + LLAMA, None),
    ("cp2-tp2-bf16", ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--bf16"], None),
    ("tp2-zero1-llama-bf16", ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"] + LLAMA,
     None),
    ("mla-tp2-sp-zero1-bf16", MLA + ["--q-lora-rank", "12", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--use-distributed-optimizer", "--bf16"], 300),
    ("mla-fsdp-dp4", MLA + ["--use-torch-fsdp2"], None),
    ("fsdp-dp4", ["--use-torch-fsdp2"], None),
    ("fsdp-tp2-bf16", ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--bf16"], None),
    ("fsdp-pp2-untied", ["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2",
                         "--untie-embeddings-and-output-weights"], None),
    ("moe-ep2", MOE + ["--expert-model-parallel-size", "2"], None),
    ("moe-ep4-zero1-bf16", MOE + ["--expert-model-parallel-size", "4", "--use-distributed-optimizer", "--bf16"], None),
    ("moe-tp2-ep2-etp1-shared", MOE + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                       "--expert-tensor-parallel-size", "1", "--swiglu",
                                       "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"],
     None),
    ("moe-freq2-pp2-zero1", MOE + ["--moe-layer-freq", "2", "--pipeline-model-parallel-size", "2",
                                   "--expert-model-parallel-size", "2", "--use-distributed-optimizer"], 400),
    ("moe-fsdp-ep2", MOE + ["--use-torch-fsdp2", "--expert-model-parallel-size", "2"], None),
    ("mtp-pp2-tied-zero1", ["--mtp-num-layers", "2", "--position-embedding-type", "rope",
                            "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], 500),
    ("mtp-tp2-pp2-untied-llama", ["--mtp-num-layers", "1", "--tensor-model-parallel-size", "2",
                                  "--pipeline-model-parallel-size", "2"] + LLAMA, None),
]


def _storage_bytes(tensor, seen: set) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()


def _measure_and_predict(layouts):
    import torch

    from megalite import topology
    from megalite.distributed import DDPConfig
    from megalite.plan import Layout, rank_state_bytes
    from megalite.training import setup
    from megalite.training.arguments import validate_args
    from megalite.training.flags import gpt_config, parse_args
    from megalite.training.gpt import model_provider

    world = torch.distributed.get_world_size()
    results = []
    original = setup.ddp_config
    for name, extra, bucket_size in layouts:
        args = validate_args(parse_args(MODEL + extra), world)
        if bucket_size is not None:
            setup.ddp_config = lambda a, b=bucket_size: DDPConfig(**{**vars(original(a)), "bucket_size": b})
        try:
            topo = topology.initialize(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                                       vpp=args.virtual_pipeline_model_parallel_size, cp=args.context_parallel_size,
                                       ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
            chunks = setup.build_model(model_provider, args, topo)
            optimizer = setup.build_optimizer(args, chunks)
        finally:
            setup.ddp_config = original
        optimizer.step()
        seen: set = set()
        weights = sum(_storage_bytes(p, seen) for c in chunks for p in c.module.parameters())
        grads = sum(_storage_bytes(p.main_grad, seen) for c in chunks for p in c.module.parameters())
        state = 0
        for shard in optimizer.shards:
            state += _storage_bytes(shard.main, seen) + _storage_bytes(shard.main.grad, seen)
            state += sum(_storage_bytes(v, seen) for v in optimizer.optimizer.state[shard.main].values()
                         if torch.is_tensor(v))
        layout = Layout.from_args(args, world)
        if bucket_size is not None:
            layout = layout.with_(bucket_size=bucket_size)
        predicted = rank_state_bytes(gpt_config(args), layout, pp_rank=topo.pp.rank, dp_rank=topo.dp_cp.rank,
                                     expert_dp_rank=topo.expert_dp.rank)
        results.append((name, (weights, grads, state), (predicted.weights, predicted.grads, predicted.optimizer)))
    return results


@pytest.mark.slow
def test_predicted_state_bytes_equal_allocated_bytes_on_every_rank():
    assert len(LAYOUTS) >= 20
    per_rank = run_distributed(_measure_and_predict, WORLD, LAYOUTS, timeout=300)
    mismatches = []
    for rank, results in enumerate(per_rank):
        assert len(results) == len(LAYOUTS)
        for name, measured, predicted in results:
            assert measured[0] > 0 and measured[1] > 0 and measured[2] > 0, (name, rank, measured)
            if measured != predicted:
                mismatches.append(f"{name} rank {rank}: measured (weights, grads, optimizer) {measured}, "
                                  f"predicted {predicted}")
    assert not mismatches, "\n".join(mismatches)
