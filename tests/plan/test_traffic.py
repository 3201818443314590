"""The planner's bytes per collective axis equal the bytes of the collectives one training step issues.

Each layout is built as ``pretrain`` builds it and runs one ``Trainer.train_step`` while every
``torch.distributed`` collective the step calls is counted: its whole buffer (see
:mod:`megalite.plan.traffic`) under the ranks of its group.  Axes that share their ranks on a layout
(the world and dp at ep=2 on 4 ranks, say) are compared together; every rank set is compared on every
rank to the byte, except the EP all-to-alls, whose per-rank payload depends on the routing: their sum over
each EP group is exact.
"""

from __future__ import annotations

import inspect

import pytest

from megalite.testing import run_distributed

WORLD = 4
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "100",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--make-vocab-size-divisible-by", "4"]
# Top-3 of 4 experts at ep=2: every token reaches both EP ranks whatever the router does, so the EP
# all-to-alls' volume (one row per (token, rank)) is routing-independent and checked to the byte.
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "3"]
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "8", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]

# (name, extra flags, DDP bucket size override or None)
LAYOUTS = [
    ("tp2-dp2", ["--tensor-model-parallel-size", "2"], None),
    ("tp2-sp-dp2-full-recompute", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--recompute-granularity", "full"], None),
    ("tp2-sp-dp2-zero1-bf16", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
                               "--use-distributed-optimizer"], None),
    ("pp2-dp2-tied", ["--pipeline-model-parallel-size", "2"], None),
    ("pp2-vpp2-tp2-zero1", ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                            "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], None),
    ("dp4-zero1-fp16-buckets", ["--use-distributed-optimizer", "--fp16", "--initial-loss-scale", "128"], 700),
    ("cp2-dp2-gqa-bf16", ["--context-parallel-size", "2", "--group-query-attention", "--num-query-groups", "2",
                          "--bf16"], None),
    ("cp2-tp2-full-recompute", ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                "--recompute-granularity", "full"], None),
    ("moe-ep2-dp4-zero1", MOE + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"], None),
    ("cp2-dp2-all-gather-gqa-bf16", ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--bf16",
                                     "--group-query-attention", "--num-query-groups", "2"], None),
    ("cp2-tp2-a2a-full-recompute", ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                    "--cp-comm-type", "a2a", "--recompute-granularity", "full",
                                    "--num-attention-heads", "8"], None),
    # ffn 38 rows over dp 4: FSDP2 pads the shards to 10 rows
    ("fsdp2-dp4-bf16-padded", ["--use-torch-fsdp2", "--bf16", "--ffn-hidden-size", "38"], None),
    ("fsdp2-tp2-sp-dp2-kept", ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--no-reshard-after-forward"], None),
    ("mla-tp2-sp-dp2-zero1-bf16", MLA + ["--q-lora-rank", "12", "--tensor-model-parallel-size", "2",
                                         "--sequence-parallel", "--use-distributed-optimizer", "--bf16"], None),
    ("mla-cp2-tp2-a2a-full-recompute", MLA + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                              "--cp-comm-type", "a2a", "--recompute-granularity", "full"], None),
    ("fsdp2-moe-ep2-pp2", MOE + ["--use-torch-fsdp2", "--expert-model-parallel-size", "2",
                                 "--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"],
     None),
    ("moe-tp2-ep2-bf16-full-recompute", MOE + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size",
                                               "2", "--bf16", "--recompute-granularity", "full"], None),
    ("moe-tp2-sp-ep2-allgather-bf16", MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                             "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                             "allgather", "--bf16"], None),
    ("moe-cp2-tp2-sp-ep2-etp1-seq-aux-loss", MOE + ["--context-parallel-size", "2", "--tensor-model-parallel-size",
                                                    "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                                                    "--expert-tensor-parallel-size", "1",
                                                    "--moe-router-load-balancing-type", "seq_aux_loss",
                                                    "--moe-aux-loss-coeff", "0.01",
                                                    "--moe-shared-expert-intermediate-size", "16",
                                                    "--moe-shared-expert-gate"], None),
]
AXES = {"dp": "dp_cp"}  # the planner's name -> the topology's, where they differ
COLLECTIVES = {  # name -> the argument that is the collective's whole buffer (FSDP2 passes it by keyword)
    "all_reduce": "tensor", "all_gather": "tensor_list", "broadcast": "tensor",
    "all_gather_into_tensor": "output_tensor", "all_gather_single": "output_tensor", "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "all_to_all_single": "input",
}


def _nbytes(tensor) -> int:
    if isinstance(tensor, (list, tuple)):  # all_gather's output list
        return sum(map(_nbytes, tensor))
    return tensor.numel() * tensor.element_size()


def _count_and_predict(layouts):
    import torch
    import torch.distributed as dist

    from megalite import topology
    from megalite.context_parallel import prepare_batch
    from megalite.distributed import DDPConfig
    from megalite.plan import Layout
    from megalite.plan.traffic import collective_bytes
    from megalite.training import gpt, setup
    from megalite.training.arguments import lr_schedule_settings, validate_args
    from megalite.training.flags import gpt_config, packing_config, parse_args
    from megalite.training.lr_schedule import LRScheduler
    from megalite.training.trainer import Trainer

    world = dist.get_world_size()
    ddp_config = setup.ddp_config
    counted: dict = {}
    counting = [False]

    def group_ranks(group):
        return tuple(range(world)) if group is None else tuple(dist.get_process_group_ranks(group))

    def add(group, nbytes):
        ranks = group_ranks(group)
        if counting[0] and len(ranks) > 1:
            counted[ranks] = counted.get(ranks, 0) + nbytes

    def wrap(name, fn, arg):
        signature = inspect.signature(fn)

        def counted_call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            add(bound.get("group"), _nbytes(bound[arg]))
            return fn(*args, **kwargs)
        return counted_call

    def batch_isend_irecv(ops):
        for op in ops:
            if op.op is dist.isend:
                add(op.group, _nbytes(op.tensor))
        return original["batch_isend_irecv"](ops)

    original = {name: getattr(dist, name) for name in list(COLLECTIVES) + ["batch_isend_irecv"] if hasattr(dist, name)}
    for name, arg in COLLECTIVES.items():
        if name in original:
            setattr(dist, name, wrap(name, original[name], arg))
    dist.batch_isend_irecv = batch_isend_irecv
    results = []
    try:
        for name, extra, bucket_size in layouts:
            args = validate_args(parse_args(MODEL + extra), world)
            topo = topology.initialize(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                                       vpp=args.virtual_pipeline_model_parallel_size, cp=args.context_parallel_size,
                                       ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
            if bucket_size is not None:
                setup.ddp_config = lambda a, b=bucket_size: DDPConfig(**{**vars(ddp_config(a)), "bucket_size": b})
            try:
                chunks = setup.build_model(gpt.model_provider, args, topo)
                optimizer = setup.build_optimizer(args, chunks)
            finally:
                setup.ddp_config = ddp_config
            trainer = Trainer(args, topo, chunks, optimizer, LRScheduler(optimizer, lr_schedule_settings(args)),
                              gpt.forward_step)
            generator = torch.Generator().manual_seed(topo.dp.rank)

            def batches(n=64):
                samples = [torch.randint(0, 100, (2, 17), generator=generator) for _ in range(n)]
                if topo.cp.size == 1:
                    return iter([{"tokens": tokens} for tokens in samples])
                return iter([prepare_batch(tokens, packing_config(args), topo.cp.size, topo.cp.rank)
                             for tokens in samples])

            data = batches() if args.virtual_pipeline_model_parallel_size is None else [batches(), batches()]
            counted.clear()
            counting[0] = True
            trainer.train_step(data, 1)
            counting[0] = False
            layout = Layout.from_args(args, world).with_(bucket_size=bucket_size or ddp_config(args).bucket_size)
            bytes_per_axis = collective_bytes(gpt_config(args), layout, args.seq_length, args.global_batch_size,
                                              topo.pp.rank, topo.dp_cp.rank)
            predicted: dict = {}
            for axis, nbytes in bytes_per_axis.items():
                ranks = tuple(range(world)) if axis == "world" else tuple(getattr(topo, AXES.get(axis, axis)).ranks)
                if len(ranks) > 1:
                    predicted[ranks] = predicted.get(ranks, 0) + nbytes
            results.append((name, dict(counted), predicted, tuple(topo.ep.ranks)))
            trainer.logger.close()
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
    return results


@pytest.mark.slow
def test_predicted_bytes_per_axis_equal_the_collectives_issued():
    per_rank = run_distributed(_count_and_predict, WORLD, LAYOUTS, timeout=300)
    mismatches = []
    for index, (name, _, _) in enumerate(LAYOUTS):
        ep_sums: dict = {}
        for rank, results in enumerate(per_rank):
            layout, counted, predicted, ep_ranks = results[index]
            assert layout == name and counted, (name, rank, counted)
            for ranks in set(counted) | set(predicted):
                if len(ep_ranks) > 1 and ranks == ep_ranks:
                    total = ep_sums.setdefault(ranks, [0, 0])
                    total[0] += counted.get(ranks, 0)
                    total[1] += predicted.get(ranks, 0)
                elif counted.get(ranks) != predicted.get(ranks):
                    mismatches.append(f"{name} rank {rank} group {ranks}: counted {counted.get(ranks)}, "
                                      f"predicted {predicted.get(ranks)}")
        for ranks, (counted_sum, predicted_sum) in ep_sums.items():
            assert counted_sum > 0, (name, ranks)
            if counted_sum != predicted_sum:
                mismatches.append(f"{name} EP group {ranks}: counted {counted_sum}, predicted {predicted_sum}")
    assert not mismatches, "\n".join(mismatches)


def _tensor_parallel_call_counts(layouts):
    """Per layout: the TP collectives a step of one more micro-batch calls, counted, and the planner's count of
    them."""
    import torch
    import torch.distributed as dist

    from megalite import topology
    from megalite.plan import Layout
    from megalite.plan.estimate import tensor_parallel_calls
    from megalite.training import gpt, setup
    from megalite.training.arguments import lr_schedule_settings, validate_args
    from megalite.training.flags import gpt_config, parse_args
    from megalite.training.lr_schedule import LRScheduler
    from megalite.training.trainer import Trainer

    world = dist.get_world_size()
    calls = [0]
    tp_ranks = [None]

    def wrap(fn):
        signature = inspect.signature(fn)

        def counted_call(*args, **kwargs):
            group = signature.bind(*args, **kwargs).arguments.get("group")
            calls[0] += group is not None and tuple(dist.get_process_group_ranks(group)) == tp_ranks[0]
            return fn(*args, **kwargs)
        return counted_call

    original = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in original.items():
        setattr(dist, name, wrap(fn))
    results = []
    try:
        for extra in layouts:
            args = validate_args(parse_args(MODEL + extra), world)
            topo = topology.initialize(tp=args.tensor_model_parallel_size)
            tp_ranks[0] = tuple(topo.tp.ranks)
            chunks = setup.build_model(gpt.model_provider, args, topo)
            optimizer = setup.build_optimizer(args, chunks)
            trainer = Trainer(args, topo, chunks, optimizer, LRScheduler(optimizer, lr_schedule_settings(args)),
                              gpt.forward_step)
            generator = torch.Generator().manual_seed(0)
            data = iter([{"tokens": torch.randint(0, 100, (2, 17), generator=generator)} for _ in range(64)])
            counted = []
            for iteration, samples in enumerate((2, 4), 1):
                calls[0] = 0
                trainer.train_step(data, iteration, samples)
                counted.append(calls[0])
            trainer.logger.close()
            layout, config = Layout.from_args(args, world), gpt_config(args)
            m = [samples // (args.micro_batch_size * layout.dp) for samples in (2, 4)]
            results.append((counted[1] - counted[0],
                            tensor_parallel_calls(config, layout, m[1]) - tensor_parallel_calls(config, layout, m[0])))
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
    return results


def test_tensor_parallel_calls_are_the_calls_a_step_makes():
    """The planner prices each TP call's fixed cost (its latency, gloo's CPU and wait per call): its count per
    micro-batch is the step's, the embedding's, output layer's and loss's calls included."""
    layouts = [["--tensor-model-parallel-size", "2"],
               ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full"]]
    for rank in run_distributed(_tensor_parallel_call_counts, 2, layouts, timeout=120):
        for extra, (counted, predicted) in zip(layouts, rank):
            assert counted == predicted > 0, (extra, counted, predicted)
