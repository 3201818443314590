"""Megatron-Core's distributed optimizer beyond even dense stages, resumed in megalite with Megatron's next losses.

On 2 CPU ranks (gloo, fp32) Megatron-Core trains :mod:`megatron_fixture`'s GPT with its own DDP, distributed
optimizer, scheduler and (pipeline) schedule, the way :mod:`megatron_optim_fixture` runs it, in eleven layouts whose
gradient buffers differ from an even split of untied dense layers in the local spec's order:

- ``tied`` (pp=2): tied embeddings over 2 even stages (the last stage keeps a copy of the word embeddings; both
  copies are in buckets of their own, their gradients all-reduced over the embedding group);
- ``uneven`` (pp=2): ``--decoder-first-pipeline-num-layers 1`` (stages of 1 and 3 layers);
- ``vpp`` (pp=2): 2 interleaved model chunks per stage (a buffer per chunk, ``gbuf_idx_<chunk>``);
- ``layout_vpp`` (pp=2): ``--pipeline-model-parallel-layout Et|tt|t|L``, 2 interleaved chunks of uneven counts
  (1 and 1 layers on rank 0, 2 and none on rank 1: its last chunk holds only the output layer);
- ``layout_mtp`` (pp=2): ``--pipeline-model-parallel-layout Ettt|tmL`` (stages of 3 and 1 layers) with a
  multi-token prediction depth on the last stage (whose buffer holds, first, a copy of the word embeddings in a
  bucket of its own, and the depth's parameters after the final norm); a layout string's stages without MTP are
  this case's less the depth, and a layout-string save read at another layout is ``layout_vpp``'s, so no case of
  ``Ettt|tL`` alone;
- ``tied_mtp`` (pp=2): ``layout_mtp`` with tied embeddings, saved only in the legacy format (:data:`LEGACY_ONLY`);
- ``accounted_vpp`` (pp=2, vpp=3): ``--account-for-embedding/loss-in-pipeline-split`` (stages of 0, 1, 1, 1, 1, 0
  layers: the first chunk holds only the embedding, the last only the output layer);
- ``te`` (dp=2): Transformer Engine's parameter order (``--transformer-impl transformer_engine``), which TE cannot
  give on this machine: its LayerNormLinear registers its fused norm's weight before its own (established from TE's
  source), so :func:`_te_order` fuses the input and pre-MLP norms into ``linear_qkv`` and ``linear_fc1`` the same
  way with Megatron-Core's local modules;
- ``moe`` (ep=2 x dp=2): :mod:`megatron_moe_fixture`'s MoE GPT, whose local experts are in a second chained
  optimizer's buffers (``chained_1.``, sharded over the expert data-parallel group);
- ``te_moe`` (ep=2 x dp=2): that MoE GPT in TE's order (:func:`_te_block_order`: the MoE layer's pre-MLP norm a
  module of its own, as the TE spec's TENorm) with a gated shared expert (``--moe-shared-expert-gate``: its
  ``gate_weight``, registered before the shared expert's linears, is megalite's ``mlp.shared_expert_gate``);
- ``grouped`` (ep=2 x dp=2): the same GPT with GroupedMLP experts (``--moe-grouped-gemm``, their grouped GEMM on
  the CPU: :mod:`megatron_grouped_fixture`), each layer's local experts two parameters ``weight1``/``weight2``,
  each expert's matrix transposed;
- ``te_grouped`` (ep=2 x dp=2): the same GPT as ``--transformer-impl transformer_engine --moe-grouped-gemm``
  registers it (TEGroupedMLP), which TE cannot give here: :func:`_te_grouped_order` builds it with Megatron-Core's
  local modules in TE's order (the input norm fused into ``linear_qkv``, the pre-MLP norm fused into
  ``linear_fc1`` only in the dense layer, and each layer's experts as TEGroupedMLP's two GroupedLinear register
  them: ``linear_fc1.weight0..weight{E-1}`` then ``linear_fc2``'s, TransformerEngine's
  ``transformer_engine/pytorch/module/grouped_linear.py`` ``GroupedLinear.__init__``).

Each is saved at iteration 2 (torch_dist, 'dp_reshardable') and trained 5 more; megalite resumes each save at
tp=1 x dp=2 (but those of :data:`AT_OWN_ONLY`), the uneven ones at their own stages (:data:`OWN_LAYOUT`), the
local-spec MoE one at ep=2 too, and its 5 losses equal Megatron's (``te_grouped`` is built, not trained: its
buffers are compared, :data:`LAYOUT_ONLY`).
Each chunk's buffer layout megalite rebuilds equals Megatron-Core's ``_ParamAndGradBuffer`` of that chunk.
The cases of :data:`LEGACY_CASES` are also saved in the legacy format from the same state
(``mp_rank_TT_PPP/model_optim_rng.pt`` and Megatron-Core's ``save_parameter_state`` into ``distrib_optim.pt``):
read behind ``--allow-pickle``, each gives the torch_dist save's weights, Adam moments and optimizer state
exactly, so it resumes with the same losses.
"""

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core.dist_checkpointing")
pytestmark = pytest.mark.slow  # Megatron-Core trains eleven runs on 2 ranks (builds a twelfth), megalite resumes them

from tests.checkpoint import megatron_fixture, megatron_optim_fixture as fixture  # noqa: E402
from tests.checkpoint import megatron_moe_fixture as moe  # noqa: E402


def _fused_norm_linear():
    """Megatron-Core's ColumnParallelLinear with an RMSNorm of its input fused in, its parameters registered in the
    order of Transformer Engine's LayerNormLinear (``layer_norm_weight``, then ``weight``), which
    ``--transformer-impl transformer_engine`` builds ``linear_qkv`` and ``linear_fc1`` of."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class FusedNormLinear(ColumnParallelLinear):
        def __init__(self, input_size, output_size, *args, **kwargs):
            super().__init__(input_size, output_size, *args, **kwargs)
            norm = torch.nn.Parameter(torch.ones(input_size))
            self._parameters = {"layer_norm_weight": norm, **self._parameters}  # TE registers it first

        def forward(self, input_, *args, **kwargs):
            normed = torch.nn.functional.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight,
                                                  self.config.layernorm_epsilon)
            return super().forward(normed, *args, **kwargs)

    return FusedNormLinear


def _te_order(spec, moe: bool = False):
    """The local layer ``spec`` with Transformer Engine's parameter order: no separate input and (but in an MoE
    layer, ``moe``) pre-MLP norms, each fused into the next linear (:func:`_fused_norm_linear`), as Megatron-Core's
    TE spec builds the layer (its MoE layer's pre-MLP norm a TENorm of its own)."""
    import copy

    from megatron.core.transformer.identity_op import IdentityOp

    spec = copy.deepcopy(spec)
    spec.submodules.input_layernorm = IdentityOp
    spec.submodules.self_attention.submodules.linear_qkv = _fused_norm_linear()
    if not moe:
        spec.submodules.pre_mlp_layernorm = IdentityOp
        spec.submodules.mlp.submodules.linear_fc1 = _fused_norm_linear()
    return spec


def _te_block_order(block):
    """The local decoder ``block`` spec of :mod:`test_megatron_moe`'s MoE GPT (an MoE and a dense layer) with each
    layer in Transformer Engine's order (:func:`_te_order`)."""
    import copy

    from megatron.core.transformer.moe.moe_layer import MoELayer

    block = copy.copy(block)
    block.layer_specs = [_te_order(layer, layer.submodules.mlp.module is MoELayer) for layer in block.layer_specs]
    return block


def _te_grouped_order(block):
    """:func:`_te_block_order` with the MoE layer's experts registered as TEGroupedMLP registers them
    (:func:`_te_grouped_experts`)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    block = _te_block_order(block)
    for layer in block.layer_specs:  # each a deep copy
        if layer.submodules.mlp.module is MoELayer:
            layer.submodules.mlp.submodules.experts.module = _te_grouped_experts()
    return block


def _te_grouped_experts():
    """Megatron-Core's SequentialMLP with its experts' weights registered in TEGroupedMLP's order (its
    ``linear_fc1``'s ``weight0``.. ``weight{E-1}``, then ``linear_fc2``'s: TE's ``GroupedLinear`` registers one
    ``[out, in]`` weight per expert, SequentialMLP's own layout) ahead of the experts' modules, so its
    ``parameters()`` (Megatron-Core's gradient buffer) follow that order; its sharded state (TEGroupedMLP's equals
    SequentialMLP's) is unchanged."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class TEGroupedOrder(SequentialMLP):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._parameters = {f"linear_fc{k}_weight{i}": getattr(expert, f"linear_fc{k}").weight
                                for k in (1, 2) for i, expert in enumerate(self.local_experts)}

    return TEGroupedOrder


def _megatron_names(layout: dict) -> dict:
    """A Megatron-Core buffer layout (:func:`megatron_optim_fixture._buffer_layout`) in megalite's names
    (:data:`_RENAMED`), :func:`_te_grouped_experts`' weights as SequentialMLP names them."""
    import re

    named = {}
    for name, place in layout.items():
        name = name.replace(*next((ours for ours in _RENAMED if ours[0] in name), ("", "")))
        named[re.sub(r"experts\.linear_fc(\d)_weight(\d+)$", r"experts.local_experts.\2.linear_fc\1.weight", name)] = \
            place
    return named


# Megatron-Core's names that megalite names otherwise: the fused norms under the TE spec, a shared expert's gate.
_RENAMED = (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
            ("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate"))
MOE_ARGS = {k: v for k, v in moe.ARGS.items() if megatron_fixture.ARGS.get(k) != v}
# Each case: (megatron_fixture.build_model's arguments (or megatron_moe_fixture.build's: MOE_CASES, at ep=2),
# Megatron-LM's args of the run).
CASES = {"tied": (dict(tied=True), dict(pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=False)),
         "uneven": (dict(num_layers_in_first_pipeline_stage=1),
                    dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)),
         "vpp": (dict(vpp=2), dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
         "layout_vpp": (dict(vpp=2, pipeline_model_parallel_layout="Et|tt|t|L"),
                        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                             pipeline_model_parallel_layout="Et|tt|t|L")),
         "layout_mtp": (dict(mtp=1, pipeline_model_parallel_layout="Ettt|tmL"),
                        dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|tmL",
                             mtp_num_layers=1, mtp_loss_scaling_factor=0.1)),
         "tied_mtp": (dict(tied=True, mtp=1, pipeline_model_parallel_layout="Ettt|tmL"),
                      dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|tmL",
                           mtp_num_layers=1, mtp_loss_scaling_factor=0.1, untie_embeddings_and_output_weights=False)),
         "accounted_vpp": (dict(vpp=3, account_for_embedding_in_pipeline_split=True,
                                account_for_loss_in_pipeline_split=True),
                           dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3,
                                account_for_embedding_in_pipeline_split=True,
                                account_for_loss_in_pipeline_split=True)),
         "te": (dict(pp=1, layer_spec=_te_order), dict(transformer_impl="transformer_engine")),
         "moe": (None, dict(MOE_ARGS, expert_model_parallel_size=2)),
         "te_moe": (dict(layer_spec=_te_block_order, gate=True),
                    dict(MOE_ARGS, expert_model_parallel_size=2, transformer_impl="transformer_engine",
                         moe_shared_expert_gate=True))}
CASES["grouped"] = (dict(grouped=True), dict(CASES["moe"][1], moe_grouped_gemm=True))
CASES["te_grouped"] = (dict(layer_spec=_te_grouped_order), dict(CASES["moe"][1], moe_grouped_gemm=True,
                                                          transformer_impl="transformer_engine"))
MOE_CASES = ("moe", "te_moe", "grouped", "te_grouped")
"""The cases of :mod:`megatron_moe_fixture`'s MoE GPT at ep=2 (CASES' first item: its ``build``'s arguments)."""
LAYOUT_ONLY = ("te_grouped",)
"""The cases whose gradient buffers are only built and compared (not trained, saved nor resumed): their state is
read by the rule of a case that is (TEGroupedMLP's experts in their order, as SequentialMLP's), so the layout is
what they add."""

LEGACY_CASES = ("tied", "uneven", "vpp", "layout_vpp", "layout_mtp", "te", "moe", "te_moe", "grouped")
"""The cases also saved in the legacy format (``--ckpt-format torch``, ``distrib_optim.pt``) from the same state."""
LEGACY_ONLY = ("tied_mtp",)
"""The cases saved only in the legacy format: Megatron-Core 0.16 trains tied embeddings with MTP layers over
stages, but its torch_dist save of them fails its own check (``tie_embeddings_and_output_weights_state_dict``
asserts that the MTP stage has no output weight, yet that stage allocates one, unused).  Their oracle is Megatron's
live state at the save (:func:`_live_state`), not resumed by megalite."""
_PP2 = ("--pipeline-model-parallel-size", "2")
OWN_LAYOUT = {"uneven": (*_PP2, "--decoder-first-pipeline-num-layers", "1"),
              "layout_vpp": (*_PP2, "--pipeline-model-parallel-layout", "Et|tt|t|L"),
              "layout_mtp": (*_PP2, "--pipeline-model-parallel-layout", "Ettt|tmL"),
              "accounted_vpp": (*_PP2, "--virtual-pipeline-model-parallel-size", "3",
                                "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")}
AT_OWN_ONLY = ("layout_mtp", "accounted_vpp")
"""megalite's flags of the cases it also resumes at their own stages (``<case>_own.jsonl``), those of
:data:`AT_OWN_ONLY` only there (their tp=1 x dp=2 resumptions would add time, not a rule: the others show the state
maps at another layout)."""


def _live_state(module, optimizer) -> dict:
    """``{name (global layer numbers): (weight, exp_avg, exp_avg_sq)}`` of this rank's parameters of ``module`` in
    Megatron-Core's distributed optimizer ``optimizer`` at dp=1 (each main shard the whole fp32 parameter)."""
    import re

    offset = module.decoder.layers[0].layer_number - 1 if len(module.decoder.layers) else 0
    names = {param: re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", n)
             for n, param in module.named_parameters()}
    state = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for params, shards in zip(inner.model_fp32_groups, inner.shard_fp32_groups):
            for param, shard in zip(params, shards):
                moments = inner.optimizer.state[shard]
                state[names[param]] = tuple(t.detach().view(param.shape).clone() for t in
                                            (param, moments["exp_avg"], moments["exp_avg_sq"]))
    return state


def _megatron_run(root: str, micro_batches, case: str):
    """Megatron-Core's run of ``case`` on this rank: ``(its losses (last stage; else None), each model chunk's
    buffer layout (:func:`megatron_optim_fixture._buffer_layout`; the MoE run's expert buffer after the dense
    one), for :data:`LEGACY_ONLY` cases its live state at the save (:func:`_live_state`))``, saved into
    ``root/case``."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    build, args = CASES[case]
    if case in MOE_CASES:
        modules = moe.build(2, seed=1, **(build or {}))
    else:
        build = dict(build)
        modules = megatron_fixture.build_model(1, build.pop("pp", 2), **build)
    modules = modules if isinstance(modules, list) else [modules]
    chunks = []
    for index, module in enumerate(modules):
        module.config.finalize_model_grads_func = finalize_model_grads
        # As Megatron-LM's get_model: chunks after the first are not split into buckets.
        chunks.append(DistributedDataParallel(module.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), module, disable_bucketing=index > 0))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=fixture.SCHEDULE["max_lr"], min_lr=fixture.SCHEDULE["min_lr"],
        weight_decay=fixture.SCHEDULE["start_wd"], adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0,
        use_distributed_optimizer=True), chunks)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, **fixture.SCHEDULE)
    layouts = [fixture._buffer_layout(buffers[0], module,
                                      module.decoder.layers[0].layer_number - 1 if len(module.decoder.layers) else 0)
               for chunk, module in zip(chunks, modules) for buffers in (chunk.buffers, chunk.expert_parallel_buffers)
               if buffers]
    if case in LAYOUT_ONLY:
        parallel_state.destroy_model_parallel()
        return None, layouts, None
    model = chunks if len(chunks) > 1 else chunks[0]
    per_iteration = len(micro_batches) // fixture.TOTAL
    losses, live = [], None
    for i in range(fixture.TOTAL):
        if i == fixture.SAVED_AT:
            if case in LEGACY_ONLY:
                live = _live_state(modules[0], optimizer)
            else:
                fixture._save(os.path.join(root, case), fixture.SAVED_AT, model, optimizer, scheduler,
                              distributed=True, **args)
            if case in LEGACY_CASES + LEGACY_ONLY:
                fixture._save_legacy(os.path.join(root, case + fixture.LEGACY), fixture.SAVED_AT, model, optimizer,
                                     scheduler, distributed=True, **args)
        batch = micro_batches[i * per_iteration:(i + 1) * per_iteration]
        dp = parallel_state.get_data_parallel_world_size()  # the MoE run: each DP rank one of the 2 micro-batches
        losses.append(fixture._train_step(model, optimizer, scheduler, batch[dist.get_rank() % dp::dp]))
    parallel_state.destroy_model_parallel()
    return (None if None in losses else losses), layouts, live


def _run(root: str, micro_batches):
    """Megatron-Core's runs of every case, then megalite's resumption of each in the same rank processes."""
    fixture.patch_cuda()
    # The distributed optimizer's checks of CUDA tensor types see the CPU tensors as CUDA ones (as in the fixture).
    cpu_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *args, **kwargs: (cpu_type(self, *args, **kwargs) if args or kwargs else
                                                        cpu_type(self).replace("torch.", "torch.cuda.", 1))
    runs = {case: _megatron_run(root, micro_batches, case) for case in CASES}
    torch.Tensor.type = cpu_type
    outputs = fixture.resume(
        [(os.path.join(root, case), os.path.join(root, f"{case}.jsonl"), ()) for case in CASES
         if case not in AT_OWN_ONLY + LAYOUT_ONLY + LEGACY_ONLY]
        + [(os.path.join(root, case), os.path.join(root, f"{case}_own.jsonl"), flags)
           for case, flags in OWN_LAYOUT.items()]
        + [(os.path.join(root, "moe"), os.path.join(root, "moe_ep2.jsonl"), ("--expert-model-parallel-size", "2"))])
    return runs, [text for text, *_ in outputs]


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """``(save root, {case: (Megatron's losses, [each rank's chunk layouts])}, rank 0's outputs of megalite's
    resumed runs)``."""
    from megalite.testing import run_distributed

    root = str(tmp_path_factory.mktemp("megatron_distopt_layouts"))
    for case in CASES:
        os.makedirs(os.path.join(root, case))
    results = run_distributed(_run, 2, root, fixture.micro_batches(), timeout=300)
    runs = {case: (results[1][0][case][0], [r[0][case][1] for r in results], [r[0][case][2] for r in results])
            for case in CASES}
    return root, runs, results[0][1]


def test_distributed_optimizer_states_continue_the_megatron_losses(megatron_runs):
    """Tied embeddings over stages, uneven stages (by first-stage count, by layout string with uneven
    interleaved chunks and with an MTP depth on the last stage, and by counting the embedding and loss as a
    layer with 3 interleaved chunks), interleaved chunks, TE's order and experts in a chained optimizer
    (SequentialMLP's, also in TE's order with a gated shared expert, and GroupedMLP's): megalite resumes each
    Megatron save at tp=1 x dp=2 (but the last two uneven ones) and the uneven ones at their own stages, pp=2, by
    the same flags (:data:`OWN_LAYOUT`; the local-spec MoE one also at ep=2) with Megatron's next 5 losses, without
    a warning about the optimizer state."""
    root, runs, outputs = megatron_runs
    assert not any("warning: the Megatron optimizer state" in out for out in outputs), outputs
    for case in CASES:
        if case not in AT_OWN_ONLY + LAYOUT_ONLY + LEGACY_ONLY:
            fixture.assert_equal_losses(fixture.losses(os.path.join(root, f"{case}.jsonl")),
                                        runs[case][0][fixture.SAVED_AT:])
    for case in OWN_LAYOUT:
        fixture.assert_equal_losses(fixture.losses(os.path.join(root, f"{case}_own.jsonl")),
                                    runs[case][0][fixture.SAVED_AT:])
    fixture.assert_equal_losses(fixture.losses(os.path.join(root, "moe_ep2.jsonl")), runs["moe"][0][fixture.SAVED_AT:])


def test_each_chunks_buffer_layout_equals_megatron_cores(megatron_runs):
    """megalite's rebuild of every stage's and chunk's gradient buffer (the last stage's copy of tied embeddings
    included, and an MTP stage's copy of the word embeddings with the depth's parameters; the MoE runs' dense and
    expert-parallel buffers, GroupedMLP's weight1/weight2 and TEGroupedMLP's order; Transformer Engine's order,
    whose fused norms are megalite's ``input_layernorm``/``pre_mlp_layernorm``; with tied embeddings also the MTP
    stage's unused output layer) equals Megatron-Core's ``_ParamAndGradBuffer`` in each run (a :data:`LEGACY_ONLY`
    one's model from its legacy save)."""
    from megalite.checkpoint.megatron_buffers import MTP_EMBEDDING_COPY, WORD_EMBEDDINGS, buffer_args, chunk_layouts
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_legacy import read_megatron_legacy

    root, runs, _ = megatron_runs
    for case in CASES:
        if case in LEGACY_ONLY:
            legacy = read_megatron_legacy(os.path.join(root, case + fixture.LEGACY), allow_pickle=True,
                                          vocab_size=fixture.PADDED_VOCAB)
            config, args = legacy.config, {**megatron_fixture.ARGS, **CASES[case][1]}
            shapes = {n: tuple(t.shape) for n, t in legacy.tensors.items() if not n.startswith("optimizer.")}
        else:
            reader = MegatronDistReader(os.path.join(root, "moe" if case in LAYOUT_ONLY else case))
            # a layout-only case: the MoE save's model, the case's args
            config, shapes = reader.config, reader.megatron_shapes()
            args = {**reader.args, **CASES[case][1]} if case in LAYOUT_ONLY else reader.args
        for rank, theirs in enumerate(runs[case][1]):
            stage = 0 if case in ("te",) + MOE_CASES else rank
            mine = [layout for experts in (False, True) if not experts or case in MOE_CASES for layout in
                    chunk_layouts(config, shapes, stage, **buffer_args(args), experts=experts)]
            assert len(mine) == len(theirs) == \
                {"vpp": 2, "layout_vpp": 2, "accounted_vpp": 3}.get(case, 2 if case in MOE_CASES else 1)
            for (local, names, places, unpadded), (their_places, their_unpadded) in zip(mine, theirs):
                assert unpadded == their_unpadded, (case, rank)
                theirs_named = _megatron_names(their_places)
                if case in ("layout_mtp", "tied_mtp") and rank == 1:  # the MTP stage's embedding copy: megalite's name
                    theirs_named[MTP_EMBEDDING_COPY] = theirs_named.pop(WORD_EMBEDDINGS)
                assert {n: (b, s, local[n]) for n, (b, s) in zip(names, places)} == theirs_named, (case, rank)
        if case in ("tied", "layout_mtp", "tied_mtp"):  # the word embeddings' copies in buckets of their own
            assert [len(chunks[0][1]) for chunks in runs[case][1]] == [2, 2]
        if case in ("te", "te_moe"):  # the fused norms after linear_proj: another order than the local spec's
            local, names, _, _ = chunk_layouts(reader.config, reader.megatron_shapes(), 0,
                                               **dict(buffer_args(reader.args), te=False))[0]
            assert names != mine[0][1] and sorted(names) == sorted(mine[0][1])
        if case == "te_grouped":  # the experts' buffer: every fc1 before the fc2s, not SequentialMLP's order
            local, names, _, _ = chunk_layouts(reader.config, reader.megatron_shapes(), 0, experts=True,
                                               **dict(buffer_args(args), expert_module="sequential"))[0]
            assert names != mine[1][1] and sorted(names) == sorted(mine[1][1])
        if case == "te_moe":  # the MoE layer's own pre-MLP norm; the gate, the shared expert's own, before its linears
            names = mine[0][1]
            assert "decoder.layers.0.pre_mlp_layernorm.weight" in names
            assert names.index("decoder.layers.0.mlp.shared_expert_gate") + 1 == \
                names.index("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")


def test_legacy_saves_give_the_torch_dist_saves_state(megatron_runs, tmp_path):
    """Tied embeddings over stages, uneven stages, interleaved chunks (a buffer per chunk in ``distrib_optim.pt``),
    an MTP depth on the last stage of a layout (whose copy of the word embeddings, Megatron's
    ``embedding.word_embeddings.weight`` there, is not read), TE's order and experts at ep=2
    (``mp_rank_00_<ep rank>``, chained dense and expert buffers; also in TE's order with a gated shared expert, and
    GroupedMLP's ``weight1|2``): Megatron-LM's
    legacy save of the same state as each torch_dist save, read behind the pickle
    opt-in, holds the same weights and Adam moments, bit for bit, and the same optimizer state.  Tied embeddings
    with an MTP depth (:data:`LEGACY_ONLY`): the legacy save holds Megatron's live weights and moments at the save,
    bit for bit (the MTP stage's copy of the word embeddings, equal to the first stage's, and its unused output
    layer not read), and its learning rate.  A
    ``distrib_optim.pt`` without a chunk's buffer is named; the weights still convert."""
    import shutil

    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_legacy import read_megatron_legacy

    root, runs, _ = megatron_runs
    for case in LEGACY_CASES:
        legacy = read_megatron_legacy(os.path.join(root, case + fixture.LEGACY), allow_pickle=True,
                                      vocab_size=fixture.PADDED_VOCAB)
        theirs = MegatronDistReader(os.path.join(root, case))
        assert legacy.optimizer_note is None, (case, legacy.optimizer_note)
        assert legacy.optimizer == theirs.state["optimizer"], case
        assert sorted(legacy.tensors) == sorted(theirs.shapes), case
        assert sum(n.startswith("optimizer.") for n in legacy.tensors) == len(theirs._flat) > 0
        for name in theirs.shapes:
            assert torch.equal(legacy.tensors[name], theirs.read(name)), (case, name)
    for case in LEGACY_ONLY:
        legacy = read_megatron_legacy(os.path.join(root, case + fixture.LEGACY), allow_pickle=True,
                                      vocab_size=fixture.PADDED_VOCAB)
        assert legacy.optimizer_note is None, (case, legacy.optimizer_note)
        first, last = runs[case][2]
        copy = last.pop("embedding.word_embeddings.weight")
        assert all(torch.equal(a, b) for a, b in zip(copy, first["embedding.word_embeddings.weight"]))
        last.pop("output_layer.weight")  # the MTP stage's unused output layer, which the sorted names below lack
        live = {**first, **last}
        assert sorted(legacy.tensors) == sorted(f"{kind}{name}" for name in live
                                                for kind in ("", "optimizer.exp_avg.", "optimizer.exp_avg_sq."))
        for name, tensors in live.items():
            for kind, tensor in zip(("", "optimizer.exp_avg.", "optimizer.exp_avg_sq."), tensors):
                assert torch.equal(legacy.tensors[kind + name], tensor), (case, kind + name)
        assert legacy.optimizer["num_steps"] == fixture.SAVED_AT
        assert legacy.scheduler["num_steps"] == fixture.SAVED_AT * fixture.GLOBAL_BATCH
    copy = str(tmp_path / "vpp")
    shutil.copytree(os.path.join(root, "vpp" + fixture.LEGACY), copy)
    path = os.path.join(copy, f"iter_{fixture.SAVED_AT:07d}", "mp_rank_00_001", "distrib_optim.pt")
    buffers = torch.load(path, weights_only=False)
    del buffers[1]
    torch.save(buffers, path)
    legacy = read_megatron_legacy(copy, allow_pickle=True, vocab_size=fixture.PADDED_VOCAB)
    assert legacy.optimizer is None and not any(n.startswith("optimizer.") for n in legacy.tensors)
    weights = [n for n in MegatronDistReader(os.path.join(root, "vpp")).shapes if not n.startswith("optimizer.")]
    assert sorted(legacy.tensors) == sorted(weights)
    assert legacy.optimizer_note == ("the distrib_optim.pt of tensor rank 0, pipeline rank 1 is not Megatron-Core's "
                                     "coalesced gradient buffers (save_parameter_state), one per model chunk (2)")
