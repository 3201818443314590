"""FSDP2 (--use-torch-fsdp2) matches the single-rank run under dp, tp x dp (SP), pp x dp, interleaved pp, EP
and cp x dp; bf16 tracks bf16 DDP; resident memory is a quarter of DDP's at dp=4; checkpoints resume across strategies;
TrainingBackend trains, saves and loads through it; bad flag combinations fail before any collective."""

import pytest
import torch

from megalite import topology
from megalite.checkpoint import load_model
from megalite.testing import run_distributed
from megalite.training.arguments import validate_args
from megalite.training.flags import parse_args
from tests.training.helpers import train

ITERS = 8
FOUR_LAYERS = ("--num-layers", "4")
EVAL = ("--eval-interval", "4", "--eval-iters", "1")
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall")


@pytest.fixture(scope="module")
def references(tiny_data, tmp_path_factory):
    """Single-rank runs (metrics, saved weights) of the three architectures the layouts use."""
    runs = {}
    for name, flags in (("dense", ()), ("deep", FOUR_LAYERS), ("moe", MOE)):
        workdir = tmp_path_factory.mktemp(f"ref-{name}")
        runs[name] = (train(tiny_data, workdir, 1, *flags, *EVAL, "--save", str(workdir / "ckpt"), iters=ITERS)[1],
                      workdir / "ckpt")
    return runs


def _weight_diffs(a, b) -> tuple[float, float]:
    """(max |difference| over every weight but the attention key biases, max |key bias| in either run).

    The loss does not depend on the key bias: it adds q . b_k to every score of a query's row, and softmax
    ignores a shift of the row. Its gradient is zero in exact arithmetic, so each run computes rounding
    noise (~1e-11, against 6e-5 for the query bias) that depends on its own summation order, and Adam,
    whose step for |g| << eps is lr * g / eps, turns that noise into steps of up to ~5e-6, different in
    each layout (1.1e-5 apart after 8 steps at tp2 x dp2 with SP). The other weights agree to 3e-7 (dense)
    and 7e-7 (MoE at ep2); the key bias is held to being noise instead (1.2e-5 at most), far below what a
    learned bias moves (the query bias: 1.8e-2).
    """
    want_model, got_model = load_model(str(a)), load_model(str(b))
    want, got = want_model.state_dict(), got_model.state_dict()
    assert want.keys() == got.keys()
    config = want_model.config
    per_group = config.num_attention_heads // config.num_query_groups + 2

    def split(name, tensor):
        """(the key-bias entries, the rest) of ``tensor``, in the grouped QKV layout of models/attention.py."""
        if not name.endswith("self_attention.linear_qkv.bias"):
            return tensor.new_zeros(0), tensor.flatten()
        slots = tensor.view(config.num_query_groups, per_group, config.kv_channels)
        return slots[:, -2].flatten(), torch.cat([slots[:, :-2].flatten(), slots[:, -1].flatten()])

    weights, key_bias = 0.0, 0.0
    for name in want:
        (want_key, want_rest), (got_key, got_rest) = split(name, want[name].double()), split(name, got[name].double())
        weights = max(weights, (want_rest - got_rest).abs().max().item())
        key_bias = max([key_bias, *(t.abs().max().item() for t in (want_key, got_key) if t.numel())])
    return weights, key_bias


@pytest.mark.parametrize("arch,flags", [
    ("dense", [*EVAL]),
    ("dense", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full"]),
    ("dense", ["--pipeline-model-parallel-size", "2"]),
    ("deep", [*FOUR_LAYERS, "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]),
    ("moe", [*MOE, "--expert-model-parallel-size", "2", "--no-reshard-after-forward"]),
    ("dense", ["--context-parallel-size", "2"]),
], ids=["dp4", "tp2dp2-sp-recompute", "pp2dp2", "pp2vpp2dp2", "ep2-edp2", "cp2dp2"])
def test_fsdp2_layouts_match_one_rank(tiny_data, tmp_path, references, arch, flags):
    reference, ref_ckpt = references[arch]
    _, got = train(tiny_data, tmp_path, 4, "--use-torch-fsdp2", *flags, "--save", str(tmp_path / "ckpt"),
                   iters=ITERS)
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1))
    assert reference[-1]["loss"] < 0.95 * reference[0]["loss"], "the reference run did not learn"
    for ref, mine in zip(reference, got):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ref["iteration"]
        assert mine["lr"] == ref["lr"]
    if "--eval-interval" in flags:
        # Only the records of eval iterations carry valid_loss: both runs evaluate at exactly 4 and 8.
        evaluated = [r["iteration"] for r in got if "valid_loss" in r]
        assert evaluated == [r["iteration"] for r in reference if "valid_loss" in r] == [4, 8]
        for ref, mine in zip(reference, got):
            if "valid_loss" in ref:
                assert mine["valid_loss"] == pytest.approx(ref["valid_loss"], rel=1e-4), ref["iteration"]
    weights, key_bias = _weight_diffs(ref_ckpt, tmp_path / "ckpt")
    assert weights <= 2e-6
    assert key_bias <= 1e-4, "the attention key bias learned: the loss depends on it, so compare it as a weight"


@pytest.mark.parametrize("precision", [["--bf16", "--accumulate-allreduce-grads-in-fp32"],
                                       ["--fp16", "--accumulate-allreduce-grads-in-fp32", "--initial-loss-scale",
                                        "131072", "--hysteresis", "1"]],
                         ids=["bf16", "fp16"])
def test_fsdp2_half_precision_tracks_ddp(tiny_data, tmp_path, precision):
    """bf16/fp16 compute on fp32 sharded main weights tracks DDP at dp=4 within half-precision tolerance;
    under fp16 the loss scaler's inf checks skip the same steps and back off the same way.  Both reduce
    gradients in fp32 (DDP always does; FSDP2 with --accumulate-allreduce-grads-in-fp32): an fp16 reduce-scatter
    of scaled gradients can overflow in the sum where DDP's fp32 sum does not, which is another computation."""
    _, ddp = train(tiny_data, tmp_path / "ddp", 4, precision[0], iters=ITERS, *precision[1:])
    _, fsdp = train(tiny_data, tmp_path / "fsdp", 4, "--use-torch-fsdp2", *precision, iters=ITERS)
    for ref, mine in zip(ddp, fsdp):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=2e-2), ref["iteration"]
        assert (mine["skipped"], mine["loss_scale"], mine["lr"]) == (ref["skipped"], ref["loss_scale"], ref["lr"])
    assert fsdp[-1]["loss"] < fsdp[0]["loss"]
    if precision[0] == "--fp16":
        assert sum(r["skipped"] for r in fsdp) > 0, "no step overflowed: the skip path went untested"


@pytest.mark.parametrize("first,second", [
    (["--use-torch-fsdp2"], ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
    (["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
     ["--pipeline-model-parallel-size", "2", "--use-torch-fsdp2"]),
], ids=["fsdp2-dp4-to-zero1-tp2dp2", "zero1-tp2dp2-to-fsdp2-pp2dp2"])
def test_resume_across_strategies(tiny_data, tmp_path, references, first, second):
    """Weights and Adam state saved by one strategy continue the run under the other, at another layout."""
    reference, _ = references["dense"]
    ckpt = str(tmp_path / "ckpt")
    stopped_at, _ = train(tiny_data, tmp_path / "a", 4, *first, "--save", ckpt, iters=ITERS,
                          sigterm_in_iteration=ITERS // 2)
    assert stopped_at == ITERS // 2
    _, resumed = train(tiny_data, tmp_path / "b", 4, *second, "--load", ckpt, iters=ITERS)
    assert [r["iteration"] for r in resumed] == list(range(ITERS // 2 + 1, ITERS + 1))
    for ref, mine in zip(reference[ITERS // 2:], resumed):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ref["iteration"]


@pytest.mark.parametrize("flags,message", [
    (["--use-torch-fsdp2", "--use-distributed-optimizer"], "are alternatives"),
    (["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble-h1",
      "--global-batch-size", "8"], "does not compose with --pipeline-schedule zero-bubble-h1"),
    (["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     "needs data-parallel x context-parallel size > 1 to shard over, got dp=1 x cp=1 (world size 4 / "
     "(tp 2 * pp 2 * cp 1))"),
])
def test_bad_flags(flags, message):
    args = parse_args(["--vocab-size", "64", *flags])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        validate_args(args, 4)


def _resident_bytes(chunk, optimizer) -> int:
    """Bytes of the distinct storages behind this rank's parameters, gradients and optimizer state."""
    tensors = []
    for p in chunk.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        tensors += [local, p.main_grad]
    for s in optimizer.shards:
        tensors.append(s.main)
        tensors += [v for v in optimizer.optimizer.state[s.main].values() if v.dim() > 0]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class _CountReduceScatters:
    """Counts the reduce-scatter collectives FSDP2 issues inside the ``with`` block."""

    def __enter__(self):
        import torch.distributed as dist

        self.count, self._original = 0, dist.reduce_scatter_tensor
        self._single = getattr(dist, "reduce_scatter_single", None)

        def counted(original):
            def call(*args, **kwargs):
                self.count += 1
                return original(*args, **kwargs)
            return call

        dist.reduce_scatter_tensor = counted(self._original)
        if self._single is not None:
            dist.reduce_scatter_single = counted(self._single)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.reduce_scatter_tensor = self._original
        if self._single is not None:
            dist.reduce_scatter_single = self._single


def _memory_and_backend_rank(directory):
    from megalite.distributed import DistributedDataParallel, FullyShardedDataParallel
    from megalite.models import GPTConfig, GPTModel
    from megalite.optim import OptimizerConfig, get_optimizer
    from megalite.rlhf.backend import TrainingBackend
    from megalite.rlhf.generation import SamplingConfig
    from megalite.rlhf.objectives import LanguageModelObjective

    topo = topology.initialize()
    config = GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                       make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (8, 12), generator=g)
    rows = slice(2 * topo.dp.rank, 2 * topo.dp.rank + 2)
    batch = {"input_ids": ids[rows], "attention_mask": torch.ones(2, 12, dtype=torch.long),
             "loss_mask": torch.ones(2, 11)}
    results = {}
    for name, wrap in (("ddp", DistributedDataParallel), ("fsdp", FullyShardedDataParallel)):
        torch.manual_seed(0)
        chunk = wrap(GPTModel(config))
        optimizer = get_optimizer(OptimizerConfig(lr=1e-3), [chunk])
        backend = TrainingBackend(chunk, optimizer, LanguageModelObjective(), micro_batch_size=1)
        losses = []
        for _ in range(3):
            with _CountReduceScatters() as reduce_scatters:
                losses.append(backend.forward_backward(batch)["lm_loss"])
            if name == "fsdp":
                # Two micro-batches, three FSDP units (two layers, the rest of the model): one reduce-scatter
                # per unit per step.
                assert reduce_scatters.count == 3, reduce_scatters.count
            grad_norm = backend.optim_step()["grad_norm"]
        if name == "fsdp":
            backend.save(directory)
        backend.forward_backward(batch)
        prompts = ids[rows, :4]
        generated = backend.generate(prompts, torch.ones_like(prompts), SamplingConfig(max_new_tokens=3, greedy=True))
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in chunk.module.named_parameters()}
        results[name] = (losses, grad_norm, weights, _resident_bytes(chunk, optimizer), generated.log_probs)
        if name == "fsdp":
            _check_backend_save_load(backend, config, batch, directory)
    return results


def _check_backend_save_load(backend, config, batch, directory):
    """An FSDP2 backend loaded from ``save()`` (same layout, other initial weights) holds the saved weights and
    Adam state: its next update is bit-identical to the original's."""
    from megalite.distributed import FullyShardedDataParallel
    from megalite.models import GPTModel
    from megalite.optim import OptimizerConfig, get_optimizer
    from megalite.rlhf.backend import TrainingBackend
    from megalite.rlhf.objectives import LanguageModelObjective

    torch.manual_seed(1)
    chunk = FullyShardedDataParallel(GPTModel(config))
    restored = TrainingBackend(chunk, get_optimizer(OptimizerConfig(lr=1e-3), [chunk]), LanguageModelObjective(),
                               micro_batch_size=1)
    restored.load(directory)
    assert restored.optimizer.num_steps == backend.optimizer.num_steps == 3
    restored.forward_backward(batch)
    for b in (backend, restored):
        b.optim_step()
    for (name, got), want in zip(restored.chunk.module.named_parameters(), backend.chunk.module.parameters()):
        assert torch.equal(got.to_local(), want.to_local()), name


def test_memory_and_training_backend(tmp_path):
    """At dp=4 each rank holds <= 1/4 + 2% of DDP's parameter + gradient + Adam bytes; TrainingBackend
    steps (and generates with) an FSDP2 chunk exactly like a DDP one, and saves and loads it."""
    for rank in run_distributed(_memory_and_backend_rank, 4, str(tmp_path / "backend")):
        (ddp_losses, ddp_norm, ddp_weights, ddp_bytes, ddp_generated), (losses, norm, weights, fsdp_bytes, generated) \
            = rank["ddp"], rank["fsdp"]
        assert torch.allclose(generated, ddp_generated, atol=1e-5)
        assert losses == pytest.approx(ddp_losses, rel=1e-5)
        assert norm == pytest.approx(ddp_norm, rel=1e-5)
        for name, want in ddp_weights.items():
            assert (weights[name] - want).abs().max().item() <= 1e-5, name
        assert fsdp_bytes <= (0.25 + 0.02) * ddp_bytes, (fsdp_bytes, ddp_bytes)
