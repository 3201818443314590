"""A Megatron-LM torch_dist checkpoint with Megatron-Core's optimizer state continues in megalite as in Megatron.

Megatron-Core trains a tiny GPT on tp=2 CPU ranks with its own DDP, optimizer and scheduler, saves after 2
iterations (model, Adam moments and step, scheduler, iteration, consumed samples) and trains 5 more
(:mod:`tests.checkpoint.megatron_optim_fixture`).  megalite resumes that save at another layout (tp=1 x dp=2)
with ``pretrain --load`` and, after ``tools/convert_checkpoint.py --from megatron``, from the converted directory:
its 5 losses equal Megatron-Core's continuation in fp32.  Without the optimizer state (the moments a fresh run
would start from) they do not.  A third Megatron-Core run, at tp=1 x dp=2 with its distributed optimizer (flat
per-bucket 'dp_reshardable' state), resumes in megalite at dp=2 and at tp=2 with the same 5 losses as Megatron's,
and so does a fourth at tp=2 x dp=1 (one buffer per tensor rank, of its shards) resumed at tp=1 x dp=2.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")
pytestmark = pytest.mark.slow  # Megatron-Core trains and saves on 2 ranks, megalite resumes on 2

from tests.checkpoint import megatron_fixture, megatron_optim_fixture as fixture  # noqa: E402
from tests.checkpoint.megatron_optim_fixture import (assert_equal_losses as _assert_equal_losses,  # noqa: E402
                                                     losses as _losses, micro_batches as _micro_batches,
                                                     resume as _resume)

def _convert_and_resume(path: str, root: str):
    """In Megatron's rank processes once its run is saved: rank 0 converts the save directory (``--from megatron``),
    then megalite resumes it directly, with its optimizer state sharded over the two DP ranks (ZeRO-1), converted,
    with fresh Adam moments (``--no-load-optim``), from a copy whose optimizer megalite cannot resume, the
    distributed optimizer's save at its layout (tp=1 x dp=2, ZeRO-1) and at tp=2, the distributed optimizer's tp=2
    save at tp=1 x dp=2 (ZeRO-1), the tp=1 x dp=2 run's legacy save (distrib_optim.pt) converted, at tp=2, and at
    Megatron's own layout
    (tp=2, where its RNG states are restored too)."""
    import torch.distributed as dist

    other, distributed = os.path.join(root, "other_groups"), path + fixture.DISTRIBUTED
    if dist.get_rank() == 0:
        assert megatron_fixture.convert("--from", "megatron", "--to", "megalite", "--input", path,
                                        "--output", os.path.join(root, "converted")) == 0
        _with_common_optimizer(path, other, _other_groups)
        for source, converted in ((path + fixture.LEGACY, "legacy"), (distributed + fixture.LEGACY, "legacy_distopt"),
                                  (path + fixture.DISTRIBUTED_TP + fixture.LEGACY, "legacy_distopt_tp2")):
            assert megatron_fixture.convert("--from", "megatron-legacy", "--to", "megalite", "--allow-pickle",
                                            "--vocab-size", str(fixture.PADDED_VOCAB), "--input", source,
                                            "--output", os.path.join(root, converted)) == 0
    dist.barrier()
    return _resume([(path, os.path.join(root, "direct.jsonl"), ()),
                    (path, os.path.join(root, "zero.jsonl"), ("--use-distributed-optimizer",)),
                    (os.path.join(root, "converted"), os.path.join(root, "converted.jsonl"), ()),
                    (path, os.path.join(root, "fresh.jsonl"), ("--no-load-optim",)),
                    (other, os.path.join(root, "other_groups.jsonl"), ()),
                    (distributed, os.path.join(root, "distopt_dp2.jsonl"), ("--use-distributed-optimizer",)),
                    (distributed, os.path.join(root, "distopt_tp2.jsonl"), ("--tensor-model-parallel-size", "2")),
                    (os.path.join(root, "legacy"), os.path.join(root, "legacy.jsonl"), ()),
                    (path + fixture.DISTRIBUTED_TP, os.path.join(root, "distopt_from_tp2.jsonl"),
                     ("--use-distributed-optimizer",)),
                    (os.path.join(root, "legacy_distopt"), os.path.join(root, "legacy_distopt.jsonl"),
                     ("--tensor-model-parallel-size", "2")),
                    (path, os.path.join(root, "tp2.jsonl"), ("--tensor-model-parallel-size", "2"))])


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """``(Megatron-LM save directory at iteration 2, Megatron-Core's losses of iterations 1..7, each tensor rank's
    fp32 main rows of the output layer of the bf16 run saved in the directory + BF16, each rank's saved RNG states,
    the losses of the distributed optimizer's runs saved in the directory + DISTRIBUTED and + DISTRIBUTED_TP, rank
    0's (output, RNG
    states) of megalite's resumed runs)``: one set of rank processes (Megatron-Core, then megalite) to keep the
    test short."""
    root = str(tmp_path_factory.mktemp("megatron_optim"))
    path = os.path.join(root, "save")
    os.makedirs(path)
    os.makedirs(path + fixture.BF16)
    os.makedirs(path + fixture.DISTRIBUTED)
    os.makedirs(path + fixture.DISTRIBUTED_TP)
    os.makedirs(path + fixture.LEGACY)
    os.makedirs(path + fixture.BF16 + fixture.LEGACY)
    return (path, *fixture.train_and_save(path, _micro_batches(), _convert_and_resume, path, root))


def test_reader_maps_the_adam_state(megatron_run):
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    reader = MegatronDistReader(megatron_run[0])
    assert reader.optimizer_note is None
    # The save holds Megatron-LM's RNG states too (one object per tensor rank; the RNG tests below read them).
    assert sorted(k for k in reader.metadata.state_dict_metadata if k.startswith("rng_state")) == \
        ["rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"]
    meta = reader.state["optimizer"]
    assert meta["num_steps"] == fixture.SAVED_AT
    assert [g["wd_mult"] for g in meta["param_groups"]] == [1.0, 0.0]
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.1, 0.0]
    assert all(g["betas"] == [0.9, 0.95] and g["eps"] == 1e-8 for g in meta["param_groups"])
    params = [name for name in reader.shapes if not name.startswith("optimizer.")]
    for name in params:
        assert reader.shapes[f"optimizer.exp_avg.{name}"] == reader.shapes[name]
        assert reader.shapes[f"optimizer.exp_avg_sq.{name}"] == reader.shapes[name]
    # Megatron-Core's second moments are squares of gradients: non-negative and, after 2 steps, not all zero.
    square = reader.read("optimizer.exp_avg_sq.decoder.layers.3.mlp.linear_fc1.weight")
    assert square.min() >= 0 and square.max() > 0


def test_reader_maps_the_fp32_main_weights_of_a_bf16_run(megatron_run):
    """Megatron-Core's mixed-precision optimizer saves ``optimizer.state.fp32_param.*``: megalite's
    ``optimizer.main.*``, equal to the fp32 weights Megatron-Core's optimizer holds (the bf16 weights round them)."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    reader = MegatronDistReader(megatron_run[0] + fixture.BF16)
    assert reader.optimizer_note is None and reader.state["optimizer"]["num_steps"] == fixture.SAVED_AT
    main = reader.read("optimizer.main.output_layer.weight")
    assert main.dtype == torch.float32 and reader.dtype("output_layer.weight") == torch.bfloat16
    assert torch.equal(main, torch.cat(megatron_run[2]))
    assert torch.equal(main.bfloat16(), reader.read("output_layer.weight"))
    assert not torch.equal(main, main.bfloat16().float())  # fp32 information the bf16 weights do not hold


def test_a_legacy_bf16_save_gives_the_fp32_main_weights_and_moments(megatron_run):
    """The bf16 run saved in the legacy format: ``optimizer.state_dict()`` of Megatron-Core's
    Float16OptimizerWithFloat16Params (chained), torch Adam's moments inside and the fp32 main weights in
    ``fp32_from_fp16_params``.  Read behind the pickle opt-in, every weight (bf16), moment and main weight (fp32)
    equals the torch_dist save's bit for bit, the output layer's main weight Megatron-Core's own, and the optimizer
    state (step, groups) is the torch_dist one's.  (Not resumed: megalite's bf16 losses on the CPU would not equal
    Megatron's within fp32 tolerances.)"""
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_legacy import read_megatron_legacy

    legacy = read_megatron_legacy(megatron_run[0] + fixture.BF16 + fixture.LEGACY, allow_pickle=True,
                                  vocab_size=fixture.PADDED_VOCAB)
    theirs = MegatronDistReader(megatron_run[0] + fixture.BF16)
    assert legacy.optimizer_note is None and legacy.optimizer == theirs.state["optimizer"]
    assert legacy.scheduler == theirs.state["megatron_scheduler"] is not None
    assert sorted(legacy.tensors) == sorted(theirs.shapes)
    params = [name for name in theirs.shapes if not name.startswith("optimizer.")]
    for name in params:
        assert legacy.tensors[name].dtype == torch.bfloat16, name
        for key in ("main", "exp_avg", "exp_avg_sq"):
            assert legacy.tensors[f"optimizer.{key}.{name}"].dtype == torch.float32, (key, name)
    for name in theirs.shapes:
        assert torch.equal(legacy.tensors[name], theirs.read(name)), name
    main = legacy.tensors["optimizer.main.output_layer.weight"]
    assert torch.equal(main, torch.cat(megatron_run[2])) and not torch.equal(main, main.bfloat16().float())


def test_pretrain_load_continues_the_megatron_losses(megatron_run):
    """Directly (also with ZeRO-1), and after ``--from megatron`` conversion; with fresh Adam moments (``--no-load-optim``, what
    ``--load`` gave before the optimizer state was read) the second loss differs."""
    path, megatron, _, _, _, runs = megatron_run
    out = [text for text, *_ in runs]
    root = os.path.dirname(path)
    assert f"loaded checkpoint {path} at iteration {fixture.SAVED_AT}" in out[0]
    assert "warning" not in "".join(out[:3])
    _assert_equal_losses(_losses(os.path.join(root, "direct.jsonl")), megatron[fixture.SAVED_AT:])
    _assert_equal_losses(_losses(os.path.join(root, "zero.jsonl")), megatron[fixture.SAVED_AT:])
    _assert_equal_losses(_losses(os.path.join(root, "converted.jsonl")), megatron[fixture.SAVED_AT:])
    fresh = _losses(os.path.join(root, "fresh.jsonl"))
    assert abs(fresh[0] - megatron[fixture.SAVED_AT]) <= 1e-5 * megatron[fixture.SAVED_AT]  # the same weights
    assert abs(fresh[1] - megatron[fixture.SAVED_AT + 1]) > 1e-3
    # An optimizer state megalite cannot resume: one warning line, then the fresh-moments run.
    assert "warning: the Megatron optimizer state is not read (its parameter groups are not Megatron's default " \
           "ones (one per weight-decay multiplier)): training from this checkpoint starts with fresh Adam moments" \
           in out[4]
    assert _losses(os.path.join(root, "other_groups.jsonl")) == fresh


def _with_common(megatron_dir, copy, key, change):
    """A copy of ``megatron_dir`` whose ``common.pt`` entry ``key`` is ``change(entry)``."""
    import shutil

    shutil.copytree(megatron_dir, copy)
    common = os.path.join(copy, f"iter_{fixture.SAVED_AT:07d}", "common.pt")
    state = torch.load(common, weights_only=False)  # written by this test's own Megatron-Core run
    state[key] = change(state[key])
    torch.save(state, common)
    return copy


def _with_common_optimizer(megatron_dir, copy, change):
    """A copy of ``megatron_dir`` whose ``common.pt`` optimizer entry is ``change(entry)``."""
    return _with_common(megatron_dir, copy, "optimizer", change)


def _other_groups(saved):
    """Megatron's optimizer entry with a learning-rate multiplier on one group (not its default groups)."""
    saved["param_groups"][0]["lr_mult"] = 2.0
    return saved


def test_the_distributed_optimizer_state_continues_the_megatron_losses(megatron_run):
    """Megatron-Core's distributed optimizer at tp=1 x dp=2, saved in its default 'dp_reshardable' layout (flat
    per-bucket DP shards): megalite maps the buckets to per-parameter Adam moments and resumes at dp=2 (ZeRO-1)
    and at tp=2 with Megatron's next 5 losses; so does its save at tp=2 x dp=1 (a buffer per tensor rank) resumed
    at tp=1 x dp=2 (ZeRO-1); without the moments (``--no-load-optim``) the second loss differs."""
    path, _, _, _, (megatron, megatron_tp2, _), runs = megatron_run
    root = os.path.dirname(path)
    assert "warning: the Megatron optimizer state" not in runs[5][0] + runs[6][0] + runs[8][0]
    for name in ("distopt_dp2.jsonl", "distopt_tp2.jsonl"):
        _assert_equal_losses(_losses(os.path.join(root, name)), megatron[fixture.SAVED_AT:])
    _assert_equal_losses(_losses(os.path.join(root, "distopt_from_tp2.jsonl")), megatron_tp2[fixture.SAVED_AT:])
    fresh = _losses(os.path.join(root, "fresh.jsonl"))  # the same data and schedule from fresh moments
    assert abs(fresh[1] - megatron[fixture.SAVED_AT + 1]) > 1e-3


def test_a_tp2_distributed_optimizer_state_is_placed_in_the_global_tensors(megatron_run):
    """At tp=2 each tensor rank's buffer holds its shards (column- and row-parallel, SwiGLU ``[gate_r; up_r]``,
    padded vocabulary rows, replicated norms): the global moments megalite assembles equal those of the same tp=2
    run with Megatron-Core's non-distributed optimizer (the same fp32 arithmetic at dp=1), for every parameter."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_distopt import PREFIX

    reader = MegatronDistReader(megatron_run[0] + fixture.DISTRIBUTED_TP)
    plain = MegatronDistReader(megatron_run[0])
    assert reader.optimizer_note is None and plain.optimizer_note is None
    assert reader.state["optimizer"] == plain.state["optimizer"]
    assert sorted(reader._flat) == sorted(name for name in plain.shapes if name.startswith("optimizer.")) != []
    assert {len(parts) for name, parts in reader._flat.items()} == {1, 2}  # replicated, split
    # Each shard's bucket and start are those of Megatron-Core's own _ParamAndGradBuffer on its tensor rank.
    for rank, layouts in enumerate(megatron_run[4][2]):
        for name, (bucket, start, shape) in layouts["tp2"][0].items():
            parts = reader._flat[f"optimizer.exp_avg.{name}"]
            if rank > 0 and len(parts) == 1:
                continue  # a replicated parameter: megalite reads tensor rank 0's copy
            key, begin, local, _, transposed = parts[rank]
            assert not transposed
            assert (key, begin, tuple(local)) == (f"{PREFIX}{rank}.gbuf_idx_0.dtype_(torch.float32, torch.float32)."
                                                  f"bucket_idx_{bucket}.exp_avg", start, shape), name
    for name in reader._flat:
        torch.testing.assert_close(reader.read(name), plain.read(name), rtol=1e-6, atol=0)


def test_each_model_parallel_ranks_buffer_layout_equals_megatron_cores(megatron_run):
    """megalite's rebuild of a tp=2 rank's and of each pp=2 stage's gradient buffer (its local shards, its layers;
    several buckets) equals Megatron-Core's ``_ParamAndGradBuffer`` of that rank's parameters."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_buffers import chunk_layouts

    reader = MegatronDistReader(megatron_run[0] + fixture.DISTRIBUTED_TP)
    shapes = reader.megatron_shapes()
    # (tp, pp, dp, bucket size, high-bandwidth padding) of each layout the Megatron-Core ranks built.
    sizes = {"tp2": (2, 1, 1, None, False), "tp2_buckets": (2, 1, 3, 2000, True), "pp2": (1, 2, 2, 1500, False)}
    for rank, layouts in enumerate(megatron_run[4][2]):
        for which, (tp, pp, dp, size, high) in sizes.items():
            (local, names, places, unpadded), = chunk_layouts(reader.config, shapes, rank if pp > 1 else 0, tp, pp,
                                                              dp, size, high)
            theirs, their_unpadded = layouts[which]
            assert unpadded == their_unpadded, (rank, which)
            assert {n: (b, s, local[n]) for n, (b, s) in zip(names, places)} == theirs, (rank, which)
        assert len(layouts["tp2_buckets"][1]) > 1 and (len(layouts["pp2"][1]) > 1) == (rank == 0)


def test_the_distributed_optimizer_state_is_read_and_converted(megatron_run, tmp_path):
    """The flat buckets become ``optimizer.<exp_avg|exp_avg_sq>.<name>`` of every parameter (fp32 run: no main
    weights beside the model's), with Megatron's step count and groups; ``--from megatron`` writes them."""
    from megalite.checkpoint import open_reader, read_checkpoint_info
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    reader = MegatronDistReader(megatron_run[0] + fixture.DISTRIBUTED)
    assert reader.optimizer_note is None
    meta = reader.state["optimizer"]
    assert meta["num_steps"] == fixture.SAVED_AT and [g["wd_mult"] for g in meta["param_groups"]] == [1.0, 0.0]
    params = [name for name in reader.shapes if not name.startswith("optimizer.")]
    assert sorted(reader._flat) == sorted(f"optimizer.{key}.{name}" for name in params
                                          for key in ("exp_avg", "exp_avg_sq"))
    square = reader.read("optimizer.exp_avg_sq.decoder.layers.3.mlp.linear_fc1.weight")
    assert square.shape == reader.shapes["decoder.layers.3.mlp.linear_fc1.weight"]
    assert square.min() >= 0 and square.max() > 0
    converted = str(tmp_path / "megalite")
    assert megatron_fixture.convert("--from", "megatron", "--to", "megalite", "--input", reader.directory,
                                    "--output", converted) == 0
    assert read_checkpoint_info(converted)["state"]["optimizer"]["num_steps"] == fixture.SAVED_AT
    mine = open_reader(converted)
    for name in ("optimizer.exp_avg.embedding.word_embeddings.weight", "optimizer.exp_avg_sq.output_layer.weight",
                 "optimizer.exp_avg.decoder.layers.0.self_attention.q_layernorm.weight"):
        assert torch.equal(mine.read(name), reader.read(name))


def test_a_legacy_save_with_its_optimizer_state_continues_the_megatron_losses(megatron_run):
    """The same Megatron-Core run saved in the legacy format (``model_optim_rng.pt``, Adam state from
    ``optimizer.state_dict()``), converted behind ``--allow-pickle`` and resumed at tp=1 x dp=2: Megatron's 5
    losses."""
    path, megatron, _, _, _, runs = megatron_run
    assert "warning: the Megatron optimizer state" not in runs[7][0]
    _assert_equal_losses(_losses(os.path.join(os.path.dirname(path), "legacy.jsonl")), megatron[fixture.SAVED_AT:])


def test_a_distributed_optimizer_state_megalite_cannot_map_is_named_and_left_out(megatron_run, tmp_path):
    """Buckets other than megalite's rebuild of Megatron's gradient buffer gives (here: args that say the run
    split it into 1000-element buckets with --overlap-grad-reduce) and Megatron's other distributed layouts are
    named, not read."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    copy = _with_common(megatron_run[0] + fixture.DISTRIBUTED, str(tmp_path / "buckets"), "args",
                        lambda args: setattr(args, "overlap_grad_reduce", True) or setattr(args, "ddp_bucket_size",
                                                                                            1000) or args)
    reader = MegatronDistReader(copy)
    assert reader.state["optimizer"] is None and not reader._flat
    assert reader.optimizer_note.startswith("it is a distributed optimizer's state ('dp_reshardable') whose buckets "
                                            "({0: 44096}) are not the [3072, 2112, 4096, ")
    assert reader.optimizer_note.endswith("elements megalite's rebuild of Megatron's gradient buffer gives for "
                                          "model-parallel rank 0")
    copy = _with_common_optimizer(megatron_run[0], str(tmp_path / "copy"),
                                  lambda saved: {"param_state_sharding_type": "fully_reshardable"})
    reader = MegatronDistReader(copy)
    assert reader.state["optimizer"] is None
    assert reader.optimizer_note == "it is a distributed optimizer's state in the 'fully_reshardable' layout, which " \
                                    "megalite does not read"


def test_an_optimizer_megalite_cannot_resume_is_named_and_left_out(megatron_run, tmp_path, capsys):
    """Parameter groups other than Megatron's default ones: the converter says so and keeps the weights."""
    from megalite.checkpoint import open_reader, read_checkpoint_info
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    copy = _with_common_optimizer(megatron_run[0], str(tmp_path / "copy"), _other_groups)
    reader = MegatronDistReader(copy)
    assert reader.state["optimizer"] is None
    assert reader.optimizer_note == "its parameter groups are not Megatron's default ones (one per weight-decay " \
                                    "multiplier)"
    converted = str(tmp_path / "megalite")
    assert megatron_fixture.convert("--from", "megatron", "--to", "megalite", "--input", copy,
                                    "--output", converted) == 0
    assert "warning: the Megatron optimizer state is not read (its parameter groups are not Megatron's default " \
           "ones (one per weight-decay multiplier)): training from this checkpoint starts with fresh Adam moments" \
           in capsys.readouterr().out
    info = read_checkpoint_info(converted)
    assert info["iteration"] == fixture.SAVED_AT and info["state"]["optimizer"] is None
    assert not any(name.startswith("optimizer.") for name in open_reader(converted).shapes)


TRACKER_WARNING = ("warning: Megatron-LM's saved RNG states tracker state 'data-parallel-rng', tracker state "
                   "'expert-parallel-rng', tracker state 'model-parallel-rng' are not restored (CUDA generator "
                   "states, and this run has no CUDA generator): what they would draw comes from this run's seeded "
                   "generators")


def test_a_legacy_distributed_optimizer_save_continues_the_megatron_losses(megatron_run, tmp_path):
    """Megatron-LM's legacy save with the distributed optimizer: ``model_optim_rng.pt`` (groups and step) and each
    model-parallel rank's ``distrib_optim.pt`` written by Megatron-Core's own ``save_parameter_state`` (the flat
    buffer gathered over DP).  Converted behind ``--allow-pickle``: the tp=1 x dp=2 run resumes at tp=2 with
    Megatron's 5 losses, and the tp=2 x dp=1 run's moments equal those its torch_dist save holds."""
    from megalite.checkpoint import open_reader, read_checkpoint_info
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.checkpoint.megatron_legacy import read_megatron_legacy

    path, _, _, _, (megatron, _, _), runs = megatron_run
    root = os.path.dirname(path)
    assert "warning: the Megatron optimizer state" not in runs[9][0]
    _assert_equal_losses(_losses(os.path.join(root, "legacy_distopt.jsonl")), megatron[fixture.SAVED_AT:])
    theirs = MegatronDistReader(path + fixture.DISTRIBUTED_TP)
    mine = open_reader(os.path.join(root, "legacy_distopt_tp2"))
    assert read_checkpoint_info(mine.directory)["state"]["optimizer"] == theirs.state["optimizer"]
    assert sorted(n for n in mine.shapes if n.startswith("optimizer.")) == sorted(theirs._flat)
    for name in theirs._flat:
        assert torch.equal(mine.read(name), theirs.read(name)), name
    # Without the pickle opt-in nothing is read; a missing distrib_optim.pt is named and the weights still convert.
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(path + fixture.DISTRIBUTED_TP + fixture.LEGACY, copy)
    with pytest.raises(ValueError, match="pass --allow-pickle"):
        read_megatron_legacy(copy)
    os.remove(os.path.join(copy, f"iter_{fixture.SAVED_AT:07d}", "mp_rank_01", "distrib_optim.pt"))
    legacy = read_megatron_legacy(copy, allow_pickle=True, vocab_size=fixture.PADDED_VOCAB)
    assert legacy.optimizer is None and not any(n.startswith("optimizer.") for n in legacy.tensors)
    assert legacy.optimizer_note == ("it is a distributed optimizer's state whose "
                                     f"{copy}/iter_{fixture.SAVED_AT:07d}/mp_rank_01/distrib_optim.pt is missing")


def test_megatron_rng_states_are_read_and_restored_at_the_same_layout(megatron_run):
    """Each rank's Python, NumPy and torch generator states and its tensor-parallel tracker's CUDA states as
    Megatron-LM saved them; ``--load`` at Megatron's own layout (tp=2) restores the CPU ones (training at dropout 0
    draws from none of them) and warns once that the tracker's CUDA states have no generator here, another layout
    (tp=1 x dp=2) keeps the states megalite's initialisation left (torch's differs, no warning), and the losses
    match either way."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    path, megatron, _, saved, _, runs = megatron_run
    reader = MegatronDistReader(path)
    for rank, theirs in enumerate(saved):
        mine = reader.rank_state(rank)["megatron_rng"]
        assert mine["python"] == theirs["random_rng_state"]
        assert mine["numpy"][0] == theirs["np_rng_state"][0] and mine["numpy"][2:] == theirs["np_rng_state"][2:]
        assert (mine["numpy"][1] == theirs["np_rng_state"][1]).all() and mine["numpy"][1].dtype == "uint32"
        assert torch.equal(mine["cpu"], theirs["torch_rng_state"]) and mine["cuda"] is None
        assert sorted(mine["tracker"]) == sorted(theirs["rng_tracker_states"]) == \
            ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]
        for name, state in theirs["rng_tracker_states"].items():
            assert torch.equal(mine["tracker"][name], state) and mine["tracker"][name].dtype == torch.uint8
    assert not torch.equal(saved[0]["rng_tracker_states"]["model-parallel-rng"],
                           saved[1]["rng_tracker_states"]["model-parallel-rng"])  # per tensor rank
    output, python, numpy, cpu = runs[-1]  # rank 0 after the tp=2 run
    assert output.count(TRACKER_WARNING) == 1 and TRACKER_WARNING not in runs[0][0]
    assert python == saved[0]["random_rng_state"] and (numpy == saved[0]["np_rng_state"][1]).all()
    assert torch.equal(cpu, saved[0]["torch_rng_state"])
    assert not torch.equal(runs[0][3], saved[0]["torch_rng_state"])  # the tp=1 x dp=2 run: not restored
    _assert_equal_losses(_losses(os.path.join(os.path.dirname(path), "tp2.jsonl")), megatron[fixture.SAVED_AT:])


def test_a_gpu_run_takes_megatrons_model_parallel_rng_state(megatron_run, monkeypatch):
    """With a CUDA generator (its two calls stood in for here), Megatron-LM's 'model-parallel-rng' state becomes the
    CUDA half of megalite's model-parallel state (its CPU half stays); the data- and expert-parallel states have no
    megalite counterpart and are named."""
    from megalite.checkpoint.megatron_dist import MegatronDistReader
    from megalite.tensor_parallel import MODEL_PARALLEL_RNG, get_rng_tracker, model_parallel_seed
    from megalite.training.checkpointing import set_megatron_rng_state

    saved = megatron_run[3]
    state = MegatronDistReader(megatron_run[0]).rank_state(1)["megatron_rng"]
    state["cuda"] = saved[1]["rng_tracker_states"]["data-parallel-rng"]  # a current CUDA state, as a GPU saves one
    model_parallel_seed(1, 1)
    cpu_half = get_rng_tracker().get_states()[MODEL_PARALLEL_RNG][0]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda new_state, device="cuda": restored.append(new_state))
    warning = set_megatron_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0], state["cuda"])
    cpu, cuda = get_rng_tracker().get_states()[MODEL_PARALLEL_RNG]
    assert torch.equal(cpu, cpu_half) and torch.equal(cuda, saved[1]["rng_tracker_states"]["model-parallel-rng"])
    assert torch.equal(torch.get_rng_state(), saved[1]["torch_rng_state"])
    assert warning == ("warning: Megatron-LM's saved RNG states tracker state 'data-parallel-rng', tracker state "
                       "'expert-parallel-rng' are not restored (megalite has no tracker state of that name): what "
                       "they would draw comes from this run's seeded generators")


def test_a_damaged_rng_state_is_one_clear_error(megatron_run, tmp_path):
    """A truncated RNG object (its bytes zeroed in the shard file) is a ValueError naming it, not a crash."""
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from megalite.checkpoint.megatron_dist import MegatronDistReader

    copy = str(tmp_path / "copy")
    shutil.copytree(megatron_run[0], copy)
    reader = MegatronDistReader(copy)
    info = reader.metadata.storage_data[MetadataIndex("rng_state/shard_0.1_1.2")]
    with open(os.path.join(reader.directory, info.relative_path), "r+b") as f:
        f.seek(info.offset + 100)
        f.write(bytes(200))
    with pytest.raises(ValueError, match=r"Megatron-LM RNG state 'rng_state/shard_0.1_1.2' in .* is unreadable"):
        reader.rank_state(1)
    assert reader.rank_state(0)["megatron_rng"]["cpu"].numel() > 0  # the other rank's object is intact
