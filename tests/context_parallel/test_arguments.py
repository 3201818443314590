"""Context-parallel and packed-sequence flags: derived sizes, and one clear error per bad input."""

import pytest

from megalite.training.arguments import validate_args
from megalite.training.flags import parse_args

NO_DROPOUT = ["--attention-dropout", "0"]


def _args(*argv, world):
    return validate_args(parse_args(list(argv)), world)


def test_context_parallel_sizes():
    args = _args("--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--cp-comm-type", "a2a",
                 "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", *NO_DROPOUT, world=8)
    assert (args.data_parallel_size, args.cp_comm_type) == (2, "a2a")
    assert args.reset_position_ids and args.reset_attention_mask and args.eod_mask_loss


@pytest.mark.parametrize("argv, world, message", [
    (["--context-parallel-size", "2", "--seq-length", "18"], 2,
     "sequence length 18 is not divisible by 2*cp = 2*2 = 4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "6", "--hidden-size", "48"], 4,
     "--cp-comm-type a2a needs the attention heads 6 and query groups 6 per tensor-parallel rank to be divisible by "
     "the context-parallel size 4"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], 2, "argument --cp-comm-type: invalid choice: 'ring'"),
    (["--context-parallel-size", "4"], 6, "world size 6 is not divisible by tp*pp*cp = 1*1*4 = 4"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2,
     "--attention-dropout 0.1 is not supported with context parallelism"),
    (["--reset-attention-mask", "--attention-dropout", "0.1"], 1,
     "--attention-dropout 0.1 is not supported with context parallelism or --reset-attention-mask"),
])
def test_bad_context_parallel_flags(argv, world, message):
    argv = argv + ([] if "--attention-dropout" in argv else NO_DROPOUT)
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        _args(*argv, world=world)
