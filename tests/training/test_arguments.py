import pytest

from megalite.training.arguments import format_args, parse_args, validate_args


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
    assert _args("--lr-warmup-fraction", "0.25", "--train-iters", "40").lr_warmup_iters == 10
    assert _args("--lr-warmup-fraction", "0.25", "--lr-warmup-iters", "3").lr_warmup_iters == 3


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
     "number of attention heads 6 is not divisible by tensor-parallel size 4"),
    (["--num-query-groups", "3"], 1, "number of attention heads 4 is not divisible by number of query groups 3"),
    (["--seq-length", "65", "--max-position-embeddings", "64"], 1,
     "sequence length 65 is greater than max position embeddings 64"),
    (["--tensor-model-parallel-size", "2"], 3, r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1 = 2"),
    (["--pipeline-model-parallel-size", "3"], 3, "num_layers=4 is not divisible by pipeline size pp=3"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5"], 2,
     "first=5 and last=None pipeline-stage layers exceed num_layers=4"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--global-batch-size", "3"], 2, "number of micro-batches 3 .* to be divisible by pipeline size 2"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     "number of experts 3 is not divisible by expert-parallel size 2"),
    (["--bf16", "--fp16"], 1, "--bf16 and --fp16 are mutually exclusive"),
    (["--fp16", "--loss-scale", "0"], 1, "--loss-scale must be positive .*got 0.0"),
    (["--lr-warmup-iters", "200"], 1, "--lr-warmup-iters 200 must be between 0 and --lr-decay-iters 100"),
    (["--lr-decay-style", "step"], 1, "argument --lr-decay-style: invalid choice: 'step'"),
    (["--num-layers"], 1, "argument --num-layers: expected one argument"),
])
def test_bad_flags(argv, world, message):
    with pytest.raises(ValueError, match=message):
        _args(*argv, world=world)


def test_unknown_default_is_rejected():
    with pytest.raises(ValueError, match="args_defaults names unknown flags: no_such"):
        parse_args([], args_defaults={"no_such": 1})
