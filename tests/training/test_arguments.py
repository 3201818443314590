import pytest

from megalite.distributed import DDPConfig
from megalite.models import GPTConfig
from megalite.moe import MoEConfig
from megalite.optim import OptimizerConfig
from megalite.training.arguments import format_args, lr_schedule_settings, validate_args
from megalite.training.flags import FLAGS, build_parser, ddp_config, gpt_config, optimizer_config, parse_args


def _args(*argv, world=1, defaults=None):
    return validate_args(parse_args(list(argv), args_defaults=defaults), world)


def test_derived_sizes():
    args = _args("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size",
                 "2", "--global-batch-size", "16", "--num-layers", "4", world=8)
    assert (args.data_parallel_size, args.num_microbatches) == (2, 4)
    assert args.max_position_embeddings == args.seq_length
    assert args.ffn_hidden_size == 4 * args.hidden_size
    assert args.lr_decay_iters == args.train_iters
    assert _args(world=4).global_batch_size == 4
    fraction, given = (lr_schedule_settings(_args(*flags, "--train-iters", "40", "--global-batch-size", "2"))
                       for flags in (["--lr-warmup-fraction", "0.25"], ["--lr-warmup-fraction", "0.25",
                                                                        "--lr-warmup-iters", "3"]))
    assert (fraction.lr_warmup_steps, given.lr_warmup_steps) == (20.0, 6)
    samples = _args("--train-samples", "96", "--global-batch-size", "8", "--lr-warmup-samples", "16")
    assert (samples.train_iters, samples.lr_decay_samples, samples.lr_decay_iters) == (12, 96, None)


def test_megatron_spellings_and_defaults():
    args = _args("--swiglu", "--hidden-size", "192", "--num-attention-heads", "6", "--group-query-attention",
                 "--num-query-groups", "2", defaults={"train_iters": 7})
    assert args.ffn_hidden_size == 512 and args.num_query_groups == 2 and args.train_iters == 7
    assert not _args("--sequence-parallel").sequence_parallel
    assert "num_query_groups ...." in format_args(args)


@pytest.mark.parametrize("argv, world, message", [
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     r"global batch size 6 is not divisible by micro batch size 2 \* data-parallel size 2 = 4"),
    (["--num-attention-heads", "6", "--hidden-size", "48", "--tensor-model-parallel-size", "4"], 4,
     "num_attention_heads=6 is not divisible by the tensor-parallel size 4"),
    (["--num-query-groups", "3"], 1, "num_attention_heads=4 is not divisible by num_query_groups=3"),
    (["--seq-length", "65", "--max-position-embeddings", "64"], 1,
     "sequence length 65 is greater than max position embeddings 64"),
    (["--tensor-model-parallel-size", "2"], 3, r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1 = 2"),
    (["--pipeline-model-parallel-size", "3"], 3, "num_layers=4 is not divisible by pipeline size pp=3"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5"], 2,
     "first=5 and last=None pipeline-stage layers exceed num_layers=4"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--global-batch-size", "3"], 2, "number of micro-batches 3 .* to be divisible by pipeline size 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"], 2,
     "tied embeddings need --untie-embeddings-and-output-weights"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--untie-embeddings-and-output-weights",
      "--virtual-pipeline-model-parallel-size", "4", "--num-layers", "8"], 2,
     r"the zbv schedule runs 2 model chunk\(s\) per pipeline rank, got 4"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble-h1",
      "--virtual-pipeline-model-parallel-size", "2"], 2, r"zero-bubble-h1 schedule runs 1 model chunk\(s\)"),
    (["--pipeline-schedule", "gpipe"], 1, "argument --pipeline-schedule: invalid choice: 'gpipe'"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     "num_experts 3 is not divisible by the expert-parallel size 2"),
    (["--bf16", "--fp16"], 1, "bf16 and fp16 are exclusive"),
    (["--fp16", "--loss-scale", "0"], 1, "loss_scale must be positive .*got 0.0"),
    (["--swiglu", "--hidden-size", "16"], 1, "GPTConfig.ffn_hidden_size must be a positive integer, got 0"),
    (["--lr-warmup-iters", "100"], 1,
     r"the lr warmup \(100 samples\) must be shorter than the lr decay \(100 samples\)"),
    (["--train-samples", "96", "--lr-decay-iters", "5"], 1, "--lr-decay-iters 5 needs iteration-based training"),
    (["--min-lr", "1.0"], 1, "--min-lr 1.0 must be between 0 and --lr 0.001"),
    (["--lr-decay-style", "step"], 1, "argument --lr-decay-style: invalid choice: 'step'"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], 1,
     "--profile-step-start 5 must be at least 1 and below --profile-step-end 5"),
    (["--num-layers"], 1, "argument --num-layers: expected one argument"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tt|tL"], 2,
     "pipeline layout 'Et|tt|tL' has 3 stages, not a multiple of the pipeline size pp=2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|ttx|t|L"], 2,
     "pipeline layout 'Et|ttx|t|L' has unknown layer letter"),
    (["--pipeline-model-parallel-layout", "Ett|ttL"], 1,
     "--pipeline-model-parallel-layout 'Ett|ttL' has 2 stages; without --pipeline-model-parallel-size it holds one"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|tL"], 2,
     "pipeline layout 'Ett|tL' has 3 decoder layers t, not num_layers=4"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|ttL",
      "--decoder-first-pipeline-num-layers", "2"], 2, "drop --decoder-first/last-pipeline-num-layers"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|ttL",
      "--account-for-loss-in-pipeline-split"], 2, "drop --account-for-loss-in-pipeline-split"),
    (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
      "--decoder-last-pipeline-num-layers", "2", "--num-layers", "5"], 2,
     "--account-for-embedding-in-pipeline-split split the layers evenly; drop --decoder-first/last"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--account-for-embedding-in-pipeline-split", "--global-batch-size", "2"], 2,
     r"num_layers=4 \+ embedding = 5 layers do not split evenly over pp=2 x vpp=2 stages"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tt|t|L",
      "--virtual-pipeline-model-parallel-size", "3"], 2,
     r"has 2 stage\(s\) per pipeline rank, but --virtual-pipeline-model-parallel-size is 3"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|ttL", "--pipeline-schedule",
      "zbv", "--untie-embeddings-and-output-weights"], 2, "--pipeline-schedule zbv places them in a V"),
])
def test_bad_flags(argv, world, message):
    with pytest.raises(ValueError, match=message):
        _args(*argv, world=world)


def test_pipeline_layout_sets_the_stages_and_virtual_size():
    """``--pipeline-model-parallel-layout`` gives each stage's layers (uneven middle stages and chunks, empty
    stages) and its stage count over pp the virtual size, which the split the trainer builds uses; so do the
    splits that count the embedding and the loss as a layer (with interleaved chunks too)."""
    from megalite.pipeline import split_layers
    from megalite.training.arguments import stage_layers

    args = _args("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|t*3|t,t|tL",
                 "--num-layers", "6", "--global-batch-size", "4", world=2)
    assert (args.virtual_pipeline_model_parallel_size, stage_layers(args)) == (2, (0, 3, 2, 1))
    assert split_layers(6, 2, 2, stage_layers=stage_layers(args)) == [[(0, 0), (3, 5)], [(0, 3), (5, 6)]]
    plain = _args("--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout", "Et|ttt|L", world=3)
    assert (plain.virtual_pipeline_model_parallel_size, stage_layers(plain)) == (None, (1, 3, 0))
    assert stage_layers(_args()) is None
    counted = _args("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3",
                    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                    "--global-batch-size", "4", world=2)
    assert stage_layers(counted) == (0, 1, 1, 1, 1, 0)
    assert stage_layers(_args("--account-for-loss-in-pipeline-split")) is None  # one stage builds every layer


def test_unknown_default_is_rejected():
    with pytest.raises(ValueError, match="args_defaults names unknown flags: no_such"):
        parse_args([], args_defaults={"no_such": 1})


def test_cli_and_api_build_identical_configs():
    """One definition per option: the same inputs through the flags and through the dataclasses agree,
    including the SwiGLU ffn size and the MoE dispatcher, whose defaults once differed between the two."""
    args = _args("--swiglu", "--hidden-size", "96", "--num-attention-heads", "6", "--num-layers", "2",
                 "--seq-length", "32", "--num-experts", "4", "--vocab-size", "100")
    api = GPTConfig(vocab_size=100, num_layers=2, hidden_size=96, num_attention_heads=6, activation="swiglu",
                    max_position_embeddings=32)
    api.moe = MoEConfig(num_experts=4, ffn_hidden_size=api.ffn_hidden_size, activation="swiglu")
    assert gpt_config(args) == api
    assert api.ffn_hidden_size == 256 and api.moe.dispatcher == "alltoall"
    assert optimizer_config(_args()) == OptimizerConfig() and ddp_config(_args()) == DDPConfig()
    flags = _args("--lr", "3e-4", "--no-overlap-grad-reduce", "--use-distributed-optimizer", "--rotary-base",
                  "500000", "--disable-bias-linear", "--position-embedding-type", "rope")
    assert optimizer_config(flags) == OptimizerConfig(lr=3e-4)
    assert ddp_config(flags) == DDPConfig(overlap_grad_reduce=False, use_distributed_optimizer=True)
    model = gpt_config(flags, vocab_size=8)
    assert (model.rotary_base, model.add_bias_linear, model.position_embedding_type) == (500000, False, "rope")


def test_help_shows_every_default():
    text = " ".join(build_parser().format_help().split())
    for flag in FLAGS:
        assert flag.name in text
    assert "--hidden-dropout HIDDEN_DROPOUT default: 0.0" in text
    assert "--moe-token-dispatcher-type {alltoall,allgather} default: alltoall" in text



def test_moe_routing_flags_and_layer_pattern_take_megatrons_forms():
    config = gpt_config(parse_args(["--num-layers", "4", "--num-experts", "4", "--moe-layer-freq", "([0]+[1])*2",
                                    "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "32",
                                    "--moe-shared-expert-gate", "--vocab-size", "64"]))
    assert config.moe_layer_freq == [0, 1, 0, 1]
    assert (config.moe.pre_softmax, config.moe.shared_expert_intermediate_size, config.moe.shared_expert_gate) == (
        True, 32, True)
    assert parse_args(["--moe-layer-freq", "2"]).moe_layer_freq == 2
    with pytest.raises(ValueError, match=r"--moe-layer-freq: '\[1,a\]' is not an int or a list expression"):
        parse_args(["--moe-layer-freq", "[1,a]"])


def test_megatrons_yarn_spellings_set_the_one_set_of_rope_fields():
    """--rope-type/--rotary-scaling-factor (Megatron's MLA spelling) and --rope-scaling-type/--rope-scaling-factor
    name the same GPTConfig fields; a spelling not given leaves the other's value alone."""
    def rope(*argv):
        cfg = gpt_config(parse_args([*argv, "--vocab-size", "64"]))
        return cfg.rope_scaling, cfg.rope_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim

    default_factor = GPTConfig.rope_scaling_factor
    assert rope() == (None, default_factor, 1.0, 0.0)
    assert rope("--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.9", "--mscale-all-dim",
                "0.7") == ("yarn", 4.0, 0.9, 0.7)
    assert rope("--rope-scaling-type", "yarn", "--rope-scaling-factor", "4") == ("yarn", 4.0, 1.0, 0.0)
    assert rope("--rope-scaling-type", "llama3", "--rope-type", "rope")[0] == "llama3"
    with pytest.raises(ValueError, match="--rope-type: invalid choice: 'llama3'"):
        parse_args(["--rope-type", "llama3"])


def test_window_size_takes_megatrons_tuple_or_the_left_size():
    assert [parse_args(["--window-size", text]).window_size for text in ("4", "(4, 0)", "(-1, 0)")] == [4, 4, None]
    assert gpt_config(parse_args(["--window-size", "(7,0)", "--vocab-size", "64"])).window_size == 7
    with pytest.raises(ValueError, match=r"--window-size: '\(4, 2\)': the window must be \(left >= 0 or -1, 0\)"):
        parse_args(["--window-size", "(4, 2)"])
