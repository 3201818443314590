"""A Megatron-LM training run with Megatron-Core's own optimizer, saved with its optimizer state and continued.

On tp=2 CPU ranks (gloo, local layer spec, fp32): Megatron-Core's GPTModel (:mod:`megatron_fixture`'s
architecture, saved without ``args.vocab_size`` so that the padded vocabulary is the model's, as Megatron's
softmax sees it) wrapped in Megatron-Core's ``DistributedDataParallel``, ``get_megatron_optimizer`` (torch
AdamW under its ``FP32Optimizer``), ``OptimizerParamScheduler``, ``forward_backward_no_pipelining`` and
``finalize_model_grads``, stepped the way Megatron-LM's ``train_step`` steps them.  After :data:`SAVED_AT`
iterations the run is saved as ``--ckpt-format torch_dist`` does (``generate_state_dict``: model, optimizer,
scheduler, RNG states, args, iteration), then trained :data:`CONTINUED` more iterations: their losses are the reference.
A second run in bf16 (``Float16Module``, Megatron-Core's mixed-precision optimizer with fp32 main
weights) is saved beside it.

Gradient clipping stays off (``clip_grad=0``): Megatron-Core's clipping asserts that gradients are CUDA tensors.
Megatron-Core's other CUDA-only calls (tensors created on ``device='cuda'``) are redirected to the CPU in the
rank processes only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os

import torch
import torch.distributed as dist

from tests.checkpoint import megatron_fixture

SAVED_AT, CONTINUED = 2, 5
TOTAL = SAVED_AT + CONTINUED
BF16 = "_bf16"
"""The suffix of the bf16 run's save directory."""
LEGACY = "_legacy"
"""The suffix of the save directory of a run's legacy-format save (``--ckpt-format torch``): the fp32 run's, and
after BF16 the bf16 run's."""
DISTRIBUTED = "_distopt"
"""The suffix of the save directory of the run with Megatron-Core's distributed optimizer (tp=1 x dp=2)."""
DISTRIBUTED_TP = "_distopt_tp2"
"""The suffix of the save directory of the run with Megatron-Core's distributed optimizer at tp=2 x dp=1."""
GLOBAL_BATCH, MICRO_BATCH, SEQ = 4, 2, 16
PADDED_VOCAB = megatron_fixture.ARGS["padded_vocab_size"]
# Megatron-LM's schedule lengths are in samples: 1 warmup iteration, cosine decay over 8, weight decay over the run.
SCHEDULE = dict(max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=GLOBAL_BATCH, lr_decay_steps=8 * GLOBAL_BATCH,
                lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=TOTAL * GLOBAL_BATCH,
                wd_incr_style="constant")
# The same run in megalite's (Megatron-LM's) flags.
FLAGS = ["--seq-length", str(SEQ), "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
         "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
         "--lr-decay-iters", "8", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
         "--adam-eps", "1e-8", "--clip-grad", "0"]


def _on_cpu(function):
    """``function`` with ``device='cuda'`` (or a CUDA device index) replaced by the CPU."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or "cuda" in str(device)):
            kwargs["device"] = "cpu"
        return function(*args, **kwargs)
    return wrapper


def patch_cuda() -> None:
    """:func:`megatron_fixture.patch_cuda`, and tensors Megatron-Core creates on (or moves to) the GPU kept on the
    CPU."""
    megatron_fixture.patch_cuda()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def batches(samples) -> list[torch.Tensor]:
    """Micro-batches ``[MICRO_BATCH, SEQ + 1]`` of the dataset ``samples`` (megalite's ``--mock-data`` train split,
    whose samples equal Megatron-Core's MockGPTDataset's), in Megatron-LM's order."""
    return [torch.stack([torch.as_tensor(samples[i]["tokens"]) for i in range(start, start + MICRO_BATCH)])
            for start in range(0, len(samples), MICRO_BATCH)]


def micro_batches() -> list[torch.Tensor]:
    """The samples megalite's ``--mock-data`` gives the run (Megatron-Core's MockGPTDataset's), vocabulary and end
    of document as the trainer derives them from the checkpoint's padded vocabulary, as :func:`batches`."""
    from megalite.data.mock import build_mock_datasets

    samples = TOTAL * GLOBAL_BATCH
    train, _, _ = build_mock_datasets(SEQ, 1234, [samples, 0, 0], PADDED_VOCAB, PADDED_VOCAB - 1)
    return batches([train[i] for i in range(samples)])


def resume(runs):
    """``pretrain --load`` of each ``(directory, metrics file, extra flags)`` in turn (at tp=1 x dp=2 unless the
    flags say otherwise), with :data:`FLAGS` to iteration :data:`TOTAL` on ``--mock-data``, in these rank processes:
    ``[(its stdout, Python's, NumPy's and torch's RNG states after it)]``."""
    import random

    import numpy as np

    from megalite.training import gpt, pretrain

    outputs = []
    for path, metrics, extra in runs:
        argv = ["--load", path, "--use-checkpoint-args", "--tensor-model-parallel-size", "1", *FLAGS,
                "--train-iters", str(TOTAL), "--metrics-file", metrics, "--log-interval", "1", "--eval-interval",
                "100", "--eval-iters", "0", "--mock-data", "--split", "100,0,0", *extra]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, argv=argv)
        outputs.append((out.getvalue(), random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()))
    return outputs


def losses(metrics) -> list[float]:
    """The losses a resumed run (:func:`resume`) wrote to its metrics file, of iterations SAVED_AT + 1 .. TOTAL."""
    records = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in records] == list(range(SAVED_AT + 1, TOTAL + 1))
    return [r["loss"] for r in records]


def assert_equal_losses(actual, expected):
    """The :data:`CONTINUED` losses equal, each within 1e-5 relative (fp32)."""
    assert len(actual) == len(expected) == CONTINUED
    for mine, theirs in zip(actual, expected):
        assert abs(mine - theirs) <= 1e-5 * abs(theirs), (actual, expected)


def _forward_step(data_iterator, model):
    """Megatron-LM's GPT forward step: mean loss over the micro-batch's tokens (no loss mask)."""
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    losses = model(inputs, positions, causal, labels=labels)

    def loss_func(output):
        total, count = output.float().sum(), torch.tensor(output.numel(), dtype=torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}
    return losses, loss_func


def _train_step(model, optimizer, scheduler, micro_batches) -> float | None:
    """One iteration as Megatron-LM's ``train_step`` runs it; its loss as Megatron-LM's ``training_log`` reports it
    (None off the last pipeline stage).  ``model``: the DDP-wrapped model, or a list of its chunks (pipelined: each
    chunk reads its own iterator of the micro-batches)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(micro_batches) for _ in chunks]
    stats = get_forward_backward_func()(forward_step_func=_forward_step,
                                        data_iterator=iterators if len(chunks) > 1 else iterators[0],
                                        model=chunks, num_microbatches=len(micro_batches), seq_length=SEQ,
                                        micro_batch_size=MICRO_BATCH, forward_only=False)
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=GLOBAL_BATCH)
    if not stats:
        return None
    total = torch.stack([s["lm loss"] for s in stats]).sum(0)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())  # as Megatron-LM's train_step
    return (total[0] / total[1]).item()


def _build(bf16: bool = False, distributed: bool = False, tp: int | None = None):
    """``(model, optimizer, scheduler)`` as Megatron-LM's ``setup_model_and_optimizer`` builds them on this rank:
    Megatron-Core's GPT (in bf16 under its ``Float16Module`` when ``bf16``) with :func:`wrap`'s DDP, optimizer and
    scheduler; with ``distributed`` with the distributed optimizer (``--use-distributed-optimizer``) at ``tp``
    (default 1: tp=1 x dp=2), else at tp=2."""
    module = megatron_fixture.build_model(tp or (1 if distributed else dist.get_world_size()), 1)
    return wrap(module, bf16, distributed)


def wrap(module, bf16: bool = False, distributed: bool = False):
    """``(model, optimizer, scheduler)``: Megatron-Core's GPT ``module`` (put in bf16 under its ``Float16Module``
    when ``bf16``) in Megatron-Core's DDP, with its Adam (:data:`FLAGS`' settings; the distributed optimizer when
    ``distributed``) and :data:`SCHEDULE`, as Megatron-LM's ``setup_model_and_optimizer`` builds them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    module.config.finalize_model_grads_func = finalize_model_grads
    if bf16:
        module.config.bf16 = True
        module = Float16Module(module.config, module)
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), module)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=SCHEDULE["max_lr"], min_lr=SCHEDULE["min_lr"], weight_decay=SCHEDULE["start_wd"],
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0, bf16=bf16,
        use_distributed_optimizer=distributed), [model])
    return model, optimizer, OptimizerParamScheduler(optimizer, init_lr=0.0, **SCHEDULE)


def _unwrapped(model):
    """The GPTModel inside DDP (and Float16Module), as Megatron-LM's ``unwrap_model`` gives it to the save."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _run(save_dir: str, micro_batches: list[torch.Tensor], then, then_args):
    from megatron.core import parallel_state

    patch_cuda()
    model, optimizer, scheduler = _build()
    per_iteration = len(micro_batches) // TOTAL
    losses = []
    for i in range(TOTAL):
        if i == SAVED_AT:
            rng = _save(save_dir, SAVED_AT, model, optimizer, scheduler)
            _save_legacy(save_dir + LEGACY, SAVED_AT, model, optimizer, scheduler)
        batch = micro_batches[i * per_iteration:(i + 1) * per_iteration]
        losses.append(_train_step(model, optimizer, scheduler, batch))
    parallel_state.destroy_model_parallel()

    # bf16 with fp32 main weights: Megatron-Core's Float16OptimizerWithFloat16Params, whose checks of CUDA tensor
    # types see the CPU tensors as CUDA ones here (as the distributed optimizer's below).
    cpu_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *args, **kwargs: (cpu_type(self, *args, **kwargs) if args or kwargs else
                                                        cpu_type(self).replace("torch.", "torch.cuda.", 1))
    model, optimizer, scheduler = _build(bf16=True)
    for i in range(SAVED_AT):  # the first iteration runs at the warmup's LR 0
        _train_step(model, optimizer, scheduler, micro_batches[i * per_iteration:(i + 1) * per_iteration])
    _save(save_dir + BF16, SAVED_AT, model, optimizer, scheduler, bf16=True)
    _save_legacy(save_dir + BF16 + LEGACY, SAVED_AT, model, optimizer, scheduler, bf16=True,
                 params_dtype=torch.bfloat16)
    weight = _unwrapped(model).output_layer.weight
    inner = optimizer.chained_optimizers[0]  # get_megatron_optimizer chains the dense parameters' one
    main = next(fp32 for half, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups)
                for param, fp32 in zip(half, mains) if param is weight)
    main = main.detach().clone()
    parallel_state.destroy_model_parallel()

    # The distributed optimizer at dp=2 (whose type checks need the same patch): each rank runs one of an
    # iteration's two micro-batches.
    model, optimizer, scheduler = _build(distributed=True)
    distributed_losses = []
    for i in range(TOTAL):
        if i == SAVED_AT:
            _save(save_dir + DISTRIBUTED, SAVED_AT, model, optimizer, scheduler, distributed=True)
            _save_legacy(save_dir + DISTRIBUTED + LEGACY, SAVED_AT, model, optimizer, scheduler, distributed=True)
        batch = micro_batches[i * per_iteration:(i + 1) * per_iteration]
        distributed_losses.append(_train_step(model, optimizer, scheduler, batch[dist.get_rank()::2]))
    parallel_state.destroy_model_parallel()
    # The distributed optimizer at tp=2 x dp=1: each tensor rank's buffer holds its shards.
    model, optimizer, scheduler = _build(distributed=True, tp=2)
    layout = {"tp2": _buffer_layout(model.buffers[0], _unwrapped(model))}
    tp_losses = []
    for i in range(TOTAL):
        if i == SAVED_AT:
            _save(save_dir + DISTRIBUTED_TP, SAVED_AT, model, optimizer, scheduler, distributed=True, tp=2)
            _save_legacy(save_dir + DISTRIBUTED_TP + LEGACY, SAVED_AT, model, optimizer, scheduler, distributed=True)
        tp_losses.append(_train_step(model, optimizer, scheduler,
                                     micro_batches[i * per_iteration:(i + 1) * per_iteration]))
    # (A second buffer takes over the parameters' storage: built once the run is over.)
    layout["tp2_buckets"] = _buffer_layout(_buffer(_unwrapped(model), 3, 2000, True), _unwrapped(model))
    parallel_state.destroy_model_parallel()
    # A pipeline stage's buffer of its layers (numbered within the stage), with DDP's buckets (first stage only).
    module = megatron_fixture.build_model(1, 2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    layout["pp2"] = _buffer_layout(_buffer(module, 2, 1500 if stage == 0 else None), module,
                                   stage * megatron_fixture.ARGS["num_layers"] // 2)
    parallel_state.destroy_model_parallel()
    torch.Tensor.type = cpu_type
    return losses, main, rng, (distributed_losses, tp_losses, layout), then(*then_args) if then is not None else None


def _buffer(module, dp: int, bucket_size: int | None, high_bandwidth: bool = False):
    """Megatron-Core's ``_ParamAndGradBuffer`` of ``module``'s parameters as its DDP builds it under the distributed
    optimizer at data-parallel size ``dp`` (a stand-in group: the layout needs only its size)."""
    import types

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer

    param_and_grad_buffer.log_on_each_pipeline_stage = lambda *args, **kwargs: None  # needs a real group
    group = types.SimpleNamespace(size=lambda: dp, rank=lambda: 0)
    named = list(module.named_parameters())
    params = [param for _, param in named]
    config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                           pad_buckets_for_high_nccl_busbw=high_bandwidth)
    return param_and_grad_buffer._ParamAndGradBuffer(
        config, torch.float32, torch.float32, params, group, bucket_size, {p: n for n, p in named}, 1.0,
        list(range(len(params))), False, types.SimpleNamespace(tp=group, dp_cp=group))


def _buffer_layout(buffer, module, layer_offset: int = 0):
    """``({parameter of module in buffer: (bucket, start in the bucket, shape)}, each bucket's unpadded size)`` of
    ``buffer``, the layers numbered from ``layer_offset`` (a pipeline stage's first layer)."""
    import re

    layout = {}
    for name, param in module.named_parameters():
        if param not in buffer.param_index_map:
            continue  # in another buffer (an expert's, at ep > 1)
        start, _, bucket = buffer.param_index_map[param]
        name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
        layout[name] = (bucket, start - buffer.buckets[bucket].offset, tuple(param.shape))
    return layout, [bucket.numel_unpadded for bucket in buffer.buckets]


def _save(save_dir: str, iteration: int, model, optimizer, scheduler, bf16: bool = False,
         distributed: bool = False, tp: int | None = None, **layout) -> dict:
    """The state dict Megatron-LM's ``generate_state_dict`` builds for ``--ckpt-format torch_dist``, saved as it
    saves it (the distributed optimizer's state in its default 'dp_reshardable' layout); returns this rank's saved
    RNG states.  ``model``: the DDP-wrapped model or a list of its chunks (``model0``, ``model1``, ... in the save);
    ``layout``: Megatron-LM's args of the pipeline (``pipeline_model_parallel_size`` ...), embeddings, experts and
    layer spec (``transformer_impl``)."""
    world = dist.get_world_size()
    tp = tp or (1 if distributed else world)
    dp = world // (tp * layout.get("pipeline_model_parallel_size", 1))
    args = argparse.Namespace(**{**megatron_fixture.ARGS, "vocab_size": None, "consumed_train_samples":
                                 iteration * GLOBAL_BATCH, "global_batch_size": GLOBAL_BATCH, "bf16": bf16,
                                 "params_dtype": torch.bfloat16 if bf16 else torch.float32,
                                 "pipeline_model_parallel_size": 1, "transformer_impl": "local", **layout},
                              tensor_model_parallel_size=tp, world_size=world,
                              data_parallel_size=dp, use_distributed_optimizer=distributed, overlap_grad_reduce=False)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    from megatron.core import parallel_state

    # As Megatron-LM's generate_state_dict: with the DP x CP group in the metadata (an MTP stage's tied copy of the
    # word embeddings needs it).
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if isinstance(model, list):
        state.update({f"model{i}": _unwrapped(chunk).sharded_state_dict(metadata=metadata)
                      for i, chunk in enumerate(model)})
    else:
        state["model"] = _unwrapped(model).sharded_state_dict(metadata=metadata)
    state["optimizer"] = optimizer.sharded_state_dict(
        state, metadata={"distrib_optim_sharding_type": "dp_reshardable"} if distributed else None)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_state()
    megatron_fixture.save_state(state, save_dir, iteration)
    return state["rng_state"].data[0]


def _save_legacy(save_dir: str, iteration: int, model, optimizer, scheduler, distributed: bool = False,
                 **layout) -> None:
    """The same state in Megatron-LM's legacy format (``--ckpt-format torch``: ``mp_rank_TT[_PPP]/model_optim_rng.pt``
    with ``optimizer.state_dict()`` and the scheduler's, written by :func:`megatron_legacy_fixture.write_rank`);
    with the distributed optimizer, as Megatron-LM's ``save_checkpoint`` does: ``model_optim_rng.pt`` from the
    first expert-DP rank, and ``distrib_optim.pt`` beside it written by Megatron-Core's ``save_parameter_state``
    (at ep > 1 each expert-parallel rank's directory has a third suffix).  ``model``: the DDP-wrapped model or a
    list of its chunks; ``layout``: Megatron-LM's args of the pipeline, embeddings, experts and layer spec, as
    :func:`_save`'s."""
    from megatron.core import parallel_state

    from tests.checkpoint.megatron_legacy_fixture import write_rank

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep > 1 else None
    args = argparse.Namespace(**{**megatron_fixture.ARGS, "vocab_size": None, "consumed_train_samples":
                                 iteration * GLOBAL_BATCH, "global_batch_size": GLOBAL_BATCH, "ckpt_format": "torch",
                                 "transformer_impl": "local", **layout, "pipeline_model_parallel_size": pp},
                              tensor_model_parallel_size=tp, world_size=dist.get_world_size(),
                              data_parallel_size=dist.get_world_size() // (tp * pp),
                              use_distributed_optimizer=distributed, overlap_grad_reduce=False)
    if parallel_state.get_expert_data_parallel_rank() == 0:
        chunks = [_unwrapped(chunk) for chunk in model] if isinstance(model, list) else _unwrapped(model)
        write_rank(save_dir, chunks, optimizer, args, tp_rank, pp_rank, pp, iteration, scheduler, ep_rank)
    dist.barrier()
    if distributed:
        rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + \
            (f"_{ep_rank:03d}" if ep_rank is not None else "")
        optimizer.save_parameter_state(os.path.join(save_dir, f"iter_{iteration:07d}", rank_dir, "distrib_optim.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def _cuda_state(seed: int, offset: int = 0) -> torch.Tensor:
    """A CUDA generator state as ``torch.cuda.get_rng_state`` returns it: its seed and offset, int64 bytes."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8).clone()


def tracker_states(seed: int = 1234) -> dict[str, torch.Tensor]:
    """The tensor-parallel tracker states Megatron-LM's ``model_parallel_cuda_manual_seed(seed)`` gives this rank
    on a GPU (data-, model- and expert-parallel: seed, seed + 2718 + tp rank, seed + 1024), built without one."""
    from megatron.core import parallel_state

    return {"data-parallel-rng": _cuda_state(seed),
            "model-parallel-rng": _cuda_state(seed + 2718 + parallel_state.get_tensor_model_parallel_rank()),
            "expert-parallel-rng": _cuda_state(seed + 1024)}


def _rng_state():
    """Megatron-LM's ``get_rng_state`` for a torch_dist save on a CPU rank: the Python, NumPy and torch generator
    states (no current CUDA state on the CPU) and the tracker's CUDA states (:func:`tracker_states`, set into
    Megatron-Core's tracker as a GPU run's seeding leaves it) as one sharded object per (pipeline, tensor) rank."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tensor_parallel.get_cuda_rng_tracker().set_states(tracker_states())
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state], (parallel_state.get_pipeline_model_parallel_world_size(),
                                                parallel_state.get_tensor_model_parallel_world_size()),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def train_and_save(save_dir: str, micro_batches: list[torch.Tensor], then=None, *then_args):
    """Megatron-Core's run on 2 ranks (tp=2), saved into ``save_dir`` after :data:`SAVED_AT` iterations, and a
    bf16 run saved into ``save_dir + BF16`` at the same iteration (both in the legacy format too, into
    ``save_dir + LEGACY`` and ``save_dir + BF16 + LEGACY``); then ``then(*then_args)`` in the same rank
    processes (which saves starting new ones).  Between them, a tp=1 x dp=2 run with the distributed optimizer is
    saved into ``save_dir + DISTRIBUTED`` at the same iteration and continued, and so is one at tp=2 x dp=1 (into
    ``save_dir + DISTRIBUTED_TP``); both in the legacy format too (``+ LEGACY``, with ``distrib_optim.pt``).  Returns ``(the losses of all
    SAVED_AT + CONTINUED iterations (micro_batches in order, 2 per iteration), each tensor rank's fp32 main rows of
    the bf16 output layer, each rank's RNG states saved in save_dir, ``(the distributed-optimizer runs' losses at
    tp=1 x dp=2 and at tp=2 x dp=1, each rank's gradient-buffer layouts (:func:`_buffer_layout`): "tp2" the
    latter's, "tp2_buckets" its parameters' at dp=3 in 2000-element buckets with high-bandwidth padding, "pp2" a
    pp=2 stage's at dp=2 in 1500-element buckets)``,
    rank 0's result of then)``."""
    from megalite.testing import run_distributed

    results = run_distributed(_run, 2, save_dir, micro_batches, then, then_args, timeout=300)
    return (results[0][0], [r[1] for r in results], [r[2] for r in results],
            (*results[0][3][:2], [r[3][2] for r in results]), results[0][4])
