"""Resharding: a checkpoint saved at tp=2 x pp=2 x dp=2 with ZeRO-1 loads under other layouts.

torch's ``dcp_to_torch_save`` turns it into plain global tensors equal to ``load_model``'s.  Loaded at tp=1
(one process, ``load_model``), tp=4, pp=4 and tp=2 x pp=2 x vpp=2 the model gives the
same logits; training resumed at tp=4, pp=4 and tp=1 x dp=4 (ZeRO-1) continues with the losses of the
run that never resharded (same global batch), which needs the sharded optimizer state resharded too.
"""

import json
import os
import shutil

import torch

from megalite.checkpoint import iteration_dir, load_model
from megalite.testing import run_distributed
from tests.training.helpers import VOCAB

SEQ = 8


def _argv(data, workdir, *extra):
    """A tiny fp32, dropout-free GPT: GQA, rope, RMSNorm, SwiGLU, tied embeddings, padded vocabulary."""
    return ["--data-path", data, "--vocab-size", str(VOCAB), "--split", "100,0,0", "--num-layers", "4",
            "--hidden-size", "32", "--num-attention-heads", "8", "--num-query-groups", "4", "--ffn-hidden-size", "64",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-2",
            "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "7", "--log-interval", "1",
            "--eval-interval", "0", "--metrics-file", os.path.join(workdir, "metrics.jsonl"), *extra]


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["iteration"]: r for r in map(json.loads, f)}


def _pretrain(argv):
    from megalite.training import gpt, pretrain

    return pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, argv=argv)


def _input_ids():
    return torch.arange(2 * SEQ).reshape(2, SEQ).mul(7).remainder(VOCAB)


def _logits(path, tp, pp, vpp=None):
    """Logits [2, SEQ, VOCAB] of the checkpoint loaded at this layout, through a hand-run pipeline."""
    import torch.distributed as dist

    from megalite import checkpoint, topology
    from megalite.models import GPTModel
    from megalite.pipeline import split_layers
    from megalite.tensor_parallel import gather_from_tensor_parallel_region

    topo = topology.initialize(tp=tp, pp=pp, vpp=vpp)
    config = checkpoint.CheckpointReader(path).config
    ranges = split_layers(config.num_layers, pp, vpp)[topo.pp.rank]
    chunks = [GPTModel(config, pre_process=topo.pp.rank == 0 and i == 0,
                       post_process=topo.pp.rank == pp - 1 and i == len(ranges) - 1, layer_range=r).eval()
              for i, r in enumerate(ranges)]
    checkpoint.load_sharded(path, chunks)
    ids, out = _input_ids(), None
    hidden_shape = (SEQ, ids.shape[0], config.hidden_size)
    with torch.no_grad():
        for virtual in range(pp * len(ranges)):
            stage, chunk = virtual % pp, virtual // pp
            if stage != topo.pp.rank:
                continue
            model = chunks[chunk]
            if virtual > 0:
                hidden = torch.empty(hidden_shape)
                dist.recv(hidden, topo.pp.ranks[(stage - 1) % pp])
                model.set_input_tensor(hidden)
            result = model(ids if model.pre_process else None)
            if virtual < pp * len(ranges) - 1:
                dist.send(result.contiguous(), topo.pp.ranks[(stage + 1) % pp])
            else:
                out = gather_from_tensor_parallel_region(result, topo.tp.group)[..., :config.vocab_size]
    dist.barrier()
    return out


def _resharded_rank(path, data, workdir):
    results = {"tp4": _logits(path, tp=4, pp=1), "pp4": _logits(path, tp=1, pp=4),
               "tp2_pp2_vpp2": _logits(path, tp=2, pp=2, vpp=2)}
    for name, layout in (("tp4", ["--tensor-model-parallel-size", "4"]), ("pp4", ["--pipeline-model-parallel-size", "4"]),
                         ("tp1_dp4", ["--use-distributed-optimizer"])):
        _pretrain(_argv(data, os.path.join(workdir, name), "--train-iters", "5", "--load", path, *layout))
    return results


def _check_dcp_to_torch(directory, model, output):
    """torch's own dcp_to_torch_save gives every global tensor under megalite's names, equal to load_model's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, output)
    plain = torch.load(output, weights_only=True)
    weights = {k: v for k, v in plain.items() if not k.startswith("optimizer.")}
    assert sorted(weights) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(weights[name], value[:VOCAB] if name == "embedding.word_embeddings.weight" else value), name
    assert {k.split(".", 2)[1] for k in plain if k.startswith("optimizer.")} == {"exp_avg", "exp_avg_sq"}


def test_checkpoint_saved_at_tp2_pp2_dp2_zero1_loads_and_resumes_under_other_layouts(tiny_data, tmp_path):
    save, reference_run = str(tmp_path / "ckpt"), str(tmp_path / "reference")
    os.makedirs(reference_run)
    run_distributed(_pretrain, 8, _argv(tiny_data, reference_run, "--tensor-model-parallel-size", "2",
                                        "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                        "--train-iters", "5", "--save", save, "--save-interval", "3"), timeout=300)
    at3 = str(tmp_path / "at3")
    shutil.copytree(iteration_dir(save, 3), iteration_dir(at3, 3))
    with open(os.path.join(at3, "latest"), "w") as f:
        f.write("3\n")

    ids = _input_ids()
    model = load_model(at3)
    with torch.no_grad():
        expected = model(ids)
    assert expected.shape == (2, SEQ, VOCAB)
    _check_dcp_to_torch(iteration_dir(at3, 3), model, str(tmp_path / "plain.pt"))

    for name in ("tp4", "pp4", "tp1_dp4"):
        os.makedirs(tmp_path / name)
    results = [r for r in run_distributed(_resharded_rank, 4, at3, tiny_data, str(tmp_path), timeout=300)]
    logits = {k: next(r[k] for r in results if r[k] is not None) for k in results[0]}
    for name, value in logits.items():
        assert (value - expected).abs().max().item() <= 1e-5, name

    reference = _losses(reference_run)
    for name in ("tp4", "pp4", "tp1_dp4"):
        resumed = _losses(tmp_path / name)
        assert sorted(resumed) == [4, 5], name
        for it in (4, 5):
            assert resumed[it]["consumed_samples"] == reference[it]["consumed_samples"]
            assert resumed[it]["lr"] == reference[it]["lr"]
            assert abs(resumed[it]["loss"] - reference[it]["loss"]) <= 1e-5, (name, it)
            assert abs(resumed[it]["grad_norm"] - reference[it]["grad_norm"]) <= 1e-5, (name, it)
    assert reference[5]["loss"] < reference[1]["loss"]
