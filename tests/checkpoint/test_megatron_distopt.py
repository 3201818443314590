"""megalite's rebuild of Megatron-Core's gradient-buffer layout under the distributed optimizer equals
Megatron-Core's own ``_ParamAndGradBuffer``: each parameter's bucket and start, each bucket's unpadded size (shared
embeddings in buckets of their own included)."""

import types

import pytest
import torch

pytest.importorskip("megatron.core.distributed.param_and_grad_buffer")


@pytest.mark.parametrize("dp, bucket_size, high_bandwidth, shared", [
    (2, None, False, ()), (3, 2000, False, ()), (3, 2000, True, ()), (4, 4096, False, ()), (2, None, False, (0,)),
    (3, 2000, False, (0, 8)), (2, None, False, (3,))])
def test_bucket_layout_equals_megatron_cores_buffer(monkeypatch, dp, bucket_size, high_bandwidth, shared):
    """``shared``: the parameters Megatron-Core marks ``shared_embedding`` (tied embeddings over stages)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as buffer

    from megalite.checkpoint.megatron_buffers import bucket_layout

    # The buffer is built on the CPU, and its closing log line (which needs a process group) is left out.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(buffer, "log_on_each_pipeline_stage", lambda *args, **kwargs: None)
    group = types.SimpleNamespace(size=lambda: dp, rank=lambda: 0)
    numels = [96 * 32, 32, 1000, 7, 4096, 130, 64, 5000, 1]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    for index in shared:
        params[index].shared_embedding = True
    config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                           pad_buckets_for_high_nccl_busbw=high_bandwidth)
    theirs = buffer._ParamAndGradBuffer(config, torch.float32, torch.float32, params, group, bucket_size,
                                        {p: str(i) for i, p in enumerate(params)}, 1.0, list(range(len(params))),
                                        False, types.SimpleNamespace(tp=group, dp_cp=group))
    places, unpadded = bucket_layout(numels, dp, bucket_size, high_bandwidth, frozenset(shared))
    assert unpadded == [b.numel_unpadded for b in theirs.buckets]
    assert len(unpadded) == (1 if bucket_size is None else 3) + len(shared) + (3 in shared)
    for param, (bucket, start) in zip(params, places):
        begin, _, their_bucket = theirs.param_index_map[param]
        assert (bucket, start) == (their_bucket, begin - theirs.buckets[their_bucket].offset)


@pytest.mark.parametrize("change, note", [
    (dict(pipeline_model_parallel_size=3), "saved with pipeline stages megalite does not place (num_layers=4 is not "
     "divisible by pipeline size pp=3; give first/last stage layer counts to split unevenly)"),
    (dict(pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True),
     "saved with pipeline stages megalite does not place (account_for_embedding_in_pipeline_split: num_layers=4 + "
     "embedding = 5 layers do not split evenly over pp=2 x vpp=1 stages, each holding at least the layer counted)"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          account_for_embedding_in_pipeline_split=True),
     "saved with pipeline stages megalite does not place (account_for_embedding_in_pipeline_split: num_layers=4 + "
     "embedding = 5 layers do not split evenly over pp=2 x vpp=2 stages, each holding at least the layer counted)"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|L",
          virtual_pipeline_model_parallel_size=3),
     "saved with pipeline stages megalite does not place (pipeline_model_parallel_layout: pipeline layout "
     "'Et|tt|t|L' has 2 stage(s) per pipeline rank, but the saved virtual_pipeline_model_parallel_size is 3)"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tttmL"),
     "saved with pipeline stages megalite does not place (pipeline_model_parallel_layout: pipeline layout "
     "'Et|tttmL' has 1 MTP layers m, not mtp_num_layers=0)"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t|t|tL"),
     "of model-parallel ranks [0], not the 2 of its tp=1 x pp=2"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3,
          account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     "of model-parallel ranks [0], not the 2 of its tp=1 x pp=2"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tttL"),
     "of model-parallel ranks [0], not the 2 of its tp=1 x pp=2"),
    (dict(pipeline_model_parallel_size=3, account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True), "of model-parallel ranks [0], not the 3 of its tp=1 x pp=3"),
    (dict(pipeline_model_parallel_size=2), "of model-parallel ranks [0], not the 2 of its tp=1 x pp=2"),
    (dict(transformer_impl="inference_optimized"), "saved with transformer_impl 'inference_optimized'; megalite "
     "reads it from runs of the local layer spec or of Transformer Engine's"),
    (dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, expert_model_parallel_size=2),
     "of 1 chained optimizers, not the 2 of its dense and expert parameters"),
])
def test_saves_whose_buffers_megalite_cannot_place_are_named(change, note):
    """Pipeline splits megalite does not rebuild (layers that do not split over the stages, Megatron's layout
    string with another chunk count than the saved one or MTP layers the model lacks (a layout megalite builds,
    interleaved chunks included, is placed: the next problem is named), splits that count the embedding or loss
    as a layer whose layers do not split so (with or without chunks, such a split that does is placed), an ep > 1
    run without its experts' chained optimizer, a layer spec other than the local and Transformer Engine's, and a
    model-parallel rank without buckets are named, not guessed at."""
    from megalite.checkpoint import global_shapes
    from megalite.checkpoint.megatron_args import config_from_megatron_args
    from megalite.checkpoint.megatron_distopt import distributed_optimizer
    from tests.checkpoint.megatron_fixture import ARGS

    args = {**ARGS, "transformer_impl": "local", "tensor_model_parallel_size": 1, **change}
    config = config_from_megatron_args(args)
    groups = [{"wd_mult": mult, "lr_mult": 1.0, "lr": 1e-3, "weight_decay": 0.1 * mult, "betas": (0.9, 0.95),
               "eps": 1e-8, "step": 2.0} for mult in (1.0, 0.0)]
    buckets = {"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_x.bucket_idx_0.exp_avg": 1}
    flat, meta, why = distributed_optimizer(args, config, global_shapes(config), buckets, {"param_groups": groups})
    assert (flat, meta) == ({}, None)
    assert why == f"it is a distributed optimizer's state ('dp_reshardable') {note}"


@pytest.mark.parametrize("num_layers, pp, vpp, embedding, loss", [
    (4, 5, None, True, False), (4, 3, None, True, True), (5, 3, None, False, True), (7, 2, None, True, False),
    (6, 2, 2, True, True), (7, 2, 2, True, False), (11, 3, 2, False, True), (4, 2, 3, True, True)])
def test_splits_that_count_the_embedding_or_loss_as_a_layer_are_megatron_cores(num_layers, pp, vpp, embedding, loss):
    """``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``, with and without
    interleaved chunks: megalite's stages of the saved args (:func:`buffer_args`' stage layer counts in its layer
    split) hold the layers Megatron-Core's ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` give
    each stage and chunk."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megalite.checkpoint.megatron_buffers import buffer_args, split_problem
    from megalite.pipeline import split_layers

    flags = dict(account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss)
    args = dict(num_layers=num_layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                **flags)
    layout = buffer_args(args)
    assert split_problem(args) is None
    ranges = split_layers(num_layers, pp, layout["vpp"], layout["first"], layout["last"],
                          stage_layers=layout["stage_layers"])
    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               pipeline_dtype=torch.float32, **flags)
    theirs = [[(offset, offset + get_num_layers_to_build(config, vp_stage=v if vpp else None, pp_rank=p))
               for v in range(vpp or 1)
               for offset in [get_transformer_layer_offset(config, vp_stage=v if vpp else None, pp_rank=p)]]
              for p in range(pp)]
    assert ranges == theirs
    assert len({hi - lo for chunks in theirs for lo, hi in chunks}) > 1  # not an even split: the flags move layers


@pytest.mark.parametrize("layout, pp", [("Et*3|(tt|)*2,tL", 4), ("E|tttt|L", 3), ("Ett|ttL", 2), ("Et|tt|tt|tL", 4),
                                        ("EttttL", 1), ("Ettt|t|tL", 3), ("Et|ttt|t|tL", 4), ("Et|t|tt|tL", 2),
                                        ("E|tt|ttt|t|t|L", 3), ("Ett|tt|t|tmL", 2), ("Et|tt|mL", 3), ("EttmmL", 1)])
def test_pipeline_layout_stages_are_megatron_cores(monkeypatch, layout, pp):
    """``--pipeline-model-parallel-layout`` -- uneven middle stages, interleaved chunks (the stage count a multiple
    of ``pp``), empty stages, MTP layers on the last stage: megalite's stages of the saved args
    (:func:`buffer_args`' chunk and stage layer counts in its layer split) hold the decoder layers Megatron-Core's
    ``PipelineParallelLayerLayout`` of the string builds on each stage and chunk."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megalite.checkpoint.megatron_buffers import buffer_args, split_problem
    from megalite.pipeline import split_layers

    theirs = PipelineParallelLayerLayout(layout, pp)
    layers, mtp = (theirs.flatten_layout.count(kind) for kind in (LayerType.decoder, LayerType.mtp))
    theirs.validate_layer_layout(layers, mtp or None)
    vpp = theirs.virtual_pipeline_model_parallel_size
    # As in a run with interleaved chunks (else Megatron-Core reads every chunk as the first).
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                        lambda: vpp if vpp > 1 else None)
    ranges = [[(start, start + theirs.get_num_layers_to_build(LayerType.decoder, vp_stage=v, pp_rank=p))
               for v in range(vpp) for start in [theirs.get_layer_offset(LayerType.decoder, vp_stage=v, pp_rank=p)]]
              for p in range(pp)]
    args = dict(num_layers=layers, pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=layout,
                mtp_num_layers=mtp or None)
    mine = buffer_args(args)
    assert split_problem(args) is None
    assert mine["vpp"] == (vpp if vpp > 1 else None)
    assert split_layers(layers, pp, mine["vpp"], mine["first"], mine["last"],
                        stage_layers=mine["stage_layers"]) == ranges


@pytest.mark.parametrize("layout, pp, mtp, error", [
    ("Et|tt|tm|L", 2, 1, "does not end with its MTP layers m and the loss: megalite computes them together on the "
                         "last stage, after its decoder layers (last stage 'L')"),
    ("tEt|ttL", 2, None, "must start with the embedding E and end with the loss L, each once"),
    ("Et|tt|tL", 2, None, "has 3 stages, not a multiple of the pipeline size pp=2")])
def test_pipeline_layouts_megalite_cannot_split_are_named(layout, pp, mtp, error):
    """Layouts megalite does not build -- MTP layers on a stage of their own before the loss's (Megatron-Core's
    standalone MTP stage), the embedding after a layer, stages that do not divide over ``pp`` -- are refused by
    the layout flag's name and the reason."""
    from megalite.checkpoint.megatron_buffers import split_problem

    args = dict(num_layers=4, pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=layout,
                mtp_num_layers=mtp)
    assert split_problem(args) == f"pipeline_model_parallel_layout: pipeline layout {layout!r} {error}"


def test_a_parsed_pipeline_layout_in_the_args_is_read_by_its_string():
    """Megatron-LM's args may hold the parsed ``PipelineParallelLayerLayout``: loaded as itself (legacy format)
    or as an inert record of its ``__dict__`` (``common.pt``), its stages are its string's."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megalite.checkpoint.megatron_buffers import buffer_args, split_problem
    from megalite.checkpoint.megatron_pickle import Opaque

    parsed = PipelineParallelLayerLayout("Et|ttt|tL", 3)
    record = Opaque()
    record.__setstate__(dict(vars(parsed)))
    for layout in (parsed, record):
        args = dict(num_layers=5, pipeline_model_parallel_size=3, pipeline_model_parallel_layout=layout)
        assert split_problem(args) is None
        assert buffer_args(args)["stage_layers"] == [1, 3, 1]
    record.__setstate__({"input_data": [["embedding", "decoder"], ["decoder", "loss"]]})  # built from a list
    args = dict(num_layers=2, pipeline_model_parallel_size=2, pipeline_model_parallel_layout=record)
    assert split_problem(args) == "pipeline_model_parallel_layout: the saved layout holds no layout string"
