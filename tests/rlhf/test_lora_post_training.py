"""LoRA through examples/sft.py and examples/dpo.py (``--finetune --load BASE --lora-rank R``).

SFT: the first loss equals the base model's on the same batch (full fine-tuning's first loss; B starts at
zero), the loaded base weights stay unchanged, the checkpoint holds the adapters (and their Adam moments) only,
and ``convert_checkpoint.py --to peft`` exports it so that ``peft.PeftModel`` on the base's HF conversion gives
megalite's logits.  DPO: the reference is the policy's own base with its adapters disabled (no second model is
built), its log-probs equal the base model's, and training moves the policy away from it.
"""

import importlib.util
import math
import os

import pytest
import torch

from megalite.testing import run_distributed
from tests.rlhf.test_dpo_example import _argv as dpo_argv
from tests.training.helpers import read_metrics
from tests.training.test_sft import _argv as sft_argv
from tests.training.test_sft import _data as sft_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def _save_base(args, path) -> None:
    """A seeded random model of the flags' architecture, saved as the base checkpoint ``--load`` reads (global
    tensors: the padded vocabulary rows cut off)."""
    from megalite.checkpoint import global_shapes, save_global_checkpoint
    from megalite.models import GPTModel
    from megalite.training.flags import gpt_config

    torch.manual_seed(11)
    config = gpt_config(args)
    state = GPTModel(config).state_dict()
    save_global_checkpoint(str(path), config, {name: state[name][tuple(slice(0, n) for n in shape)]
                                               for name, shape in global_shapes(config).items()})


def _watch(wrap, run):
    """Run ``run()`` with the model chunk's state recorded at its first forward step (``wrap(step)`` installs the
    recording step and returns a function that restores the original); returns whether every tensor of the
    chunk is unchanged at the end."""
    first = {}

    def recording(step):
        def forward_step(data_iterator, model):
            if not first:
                first.update({k: v.detach().clone() for k, v in model.state_dict().items()})
                first["_model"] = model
            return step(data_iterator, model)
        return forward_step

    restore = wrap(recording)
    try:
        run()
    finally:
        restore()
    model = first.pop("_model")
    return len(first) > 0 and all(torch.equal(first[k], v) for k, v in model.state_dict().items())


def _sft_on_rank(argv):
    """examples/sft.py's main(argv); returns whether the model chunk's tensors were left unchanged."""
    from examples.sft import main
    from megalite.training import gpt

    original = gpt.forward_step

    def wrap(recording):
        gpt.forward_step = recording(original)
        return lambda: setattr(gpt, "forward_step", original)

    return _watch(wrap, lambda: main(argv))


def _dpo_on_rank(argv):
    """examples/dpo.py's main(argv); returns (chunk tensors unchanged, no separate reference model was built)."""
    import examples.dpo as script

    original, runs = script.PreferenceTraining, []

    def wrap(recording):
        class Watched(original):
            def __init__(self):
                super().__init__()
                self.forward_step = recording(self.forward_step)
                runs.append(self)

        script.PreferenceTraining = Watched
        return lambda: setattr(script, "PreferenceTraining", original)

    unchanged = _watch(wrap, lambda: script.main(argv))
    return unchanged, runs[0].reference is None


def _convert(*argv):
    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(ROOT, "tools",
                                                                                     "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.main(list(argv))


def _adapter_names(path):
    from megalite.checkpoint import CheckpointReader

    names = set(CheckpointReader(str(path)).shapes)
    adapters = {n for n in names if n.startswith("decoder.layers.") and n.endswith((".lora_A.weight",
                                                                                    ".lora_B.weight"))}
    return names, adapters


@torch.no_grad()
def _base_sft_loss(args, base) -> float:
    """The base model's SFT loss on the run's first global batch, as the trainer reduces it: each micro-batch's
    loss-token mean (``gpt.masked_loss_func``), averaged over the micro-batches."""
    from megalite.checkpoint import load_model
    from megalite.context_parallel import prepare_batch
    from megalite.data.sampler import MicroBatchSampler
    from megalite.training.sft import sft_datasets_provider

    train, _, _ = sft_datasets_provider(args, [args.global_batch_size, 0, 0])
    model, losses = load_model(str(base)), []
    sampler = MicroBatchSampler(len(train), 0, args.micro_batch_size, args.global_batch_size, 0, 1)
    for _, indices in zip(range(args.global_batch_size // args.micro_batch_size), sampler):
        samples = [train[i] for i in indices]
        tokens, mask, docs = (torch.stack([s[k] for s in samples]) for k in ("tokens", "assistant_mask",
                                                                            "document_ids"))
        batch = prepare_batch(tokens, assistant_mask=mask, documents=docs)
        per_token = model(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                          document_ids=batch["document_ids"])
        losses.append(((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).item())
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_sft_with_lora_trains_adapters_only_and_exports_to_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from megalite.training.flags import parse_args
    from megalite.training.sft import add_sft_flags, prepare_sft_data

    data, tokenizer = sft_data(tmp_path)
    base = tmp_path / "base"
    argv = sft_argv(data, tokenizer, tmp_path, "--finetune", "--load", str(base), "--train-iters", "2",
                    "--lr-warmup-fraction", "0", "--eval-interval", "0", *LORA, "--save", str(tmp_path / "adapters"))
    args = parse_args(argv, add_sft_flags)
    prepare_sft_data(args)
    _save_base(args, base)
    assert run_distributed(_sft_on_rank, 1, argv, timeout=240) == [True]  # the loaded base weights are unchanged
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["iteration"] for r in records] == [1, 2]
    base_loss = _base_sft_loss(args, base)
    assert records[0]["loss"] == pytest.approx(base_loss, rel=1e-6)  # B = 0: the base model's loss

    names, adapters = _adapter_names(tmp_path / "adapters")
    assert len(adapters) == 2 * 4 * 2  # A and B of qkv, proj, fc1, fc2 in both layers
    moments = {f"optimizer.{key}.{n}" for key in ("exp_avg", "exp_avg_sq") for n in adapters}
    assert names == adapters | moments, sorted(names - adapters - moments)

    # PEFT export of the adapter checkpoint, loaded on the base's HF conversion: megalite's logits.
    from transformers import AutoModelForCausalLM

    from megalite.checkpoint import load_model
    from megalite.lora import apply_lora
    from megalite.lora.state import load_adapters, read_adapter_checkpoint

    assert _convert("--from", "megalite", "--to", "hf", "--input", str(base), "--output", str(tmp_path / "hf")) == 0
    assert _convert("--from", "megalite", "--to", "peft", "--input", str(tmp_path / "adapters"),
                    "--output", str(tmp_path / "peft")) == 0
    model = load_model(str(base)).eval()
    load_adapters(str(tmp_path / "adapters"), apply_lora(model, read_adapter_checkpoint(str(tmp_path / "adapters"))[0]))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    ids = torch.arange(1, 40).remainder(args.vocab_size).unsqueeze(0)
    with torch.no_grad():
        ours, peft_logits = model(input_ids=ids), theirs(input_ids=ids).logits
        with theirs.disable_adapter():
            base_logits = theirs(input_ids=ids).logits
    assert (ours - peft_logits[..., :ours.shape[-1]]).abs().max() <= 1e-5
    assert (base_logits - peft_logits).abs().max() > 1e-4  # the trained adapters change the output


@pytest.mark.slow
def test_dpo_with_lora_uses_the_base_as_reference(tmp_path):
    from megalite.rlhf.preference_training import PreferenceTraining, add_preference_flags
    from megalite.training.flags import parse_args

    base = tmp_path / "base"
    args = parse_args(dpo_argv(tmp_path, tmp_path), add_preference_flags)
    PreferenceTraining().prepare_data(args)
    _save_base(args, base)
    workdir = tmp_path / "lora"
    workdir.mkdir()
    argv = dpo_argv(tmp_path, workdir, "--finetune", "--load", str(base), *LORA, "--save", str(tmp_path / "adapters"))
    [(unchanged, no_copy)] = run_distributed(_dpo_on_rank, 1, argv, timeout=240)
    assert unchanged and no_copy
    records = [r for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    # At first the policy is its base (B = 0), so it equals the reference; after adapter updates it moves away
    # from the reference (a reference that followed the adapters would keep the loss at log 2).
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and records[0]["reward_margin"] == 0.0
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["reward_accuracy"] > 0.5
    names, adapters = _adapter_names(tmp_path / "adapters")
    assert adapters and all(n in adapters or n.startswith("optimizer.") for n in names)


def test_reference_log_probs_of_a_lora_policy_are_the_base_models():
    from megalite.context_parallel import prepare_batch
    from megalite.lora import LoRAConfig, adapters_disabled, apply_lora
    from megalite.lora.state import load_global_adapters
    from megalite.models import GPTModel
    from megalite.rlhf.preference import completion_pair, pack_pair
    from megalite.rlhf.preference_training import base_log_probs, reference_log_probs
    from tests.lora.test_adapters import _config, _random_b

    config = _config(max_position_embeddings=24)
    torch.manual_seed(5)
    policy = GPTModel(config)
    base = GPTModel(config).eval()
    base.load_state_dict(policy.state_dict())
    lora = apply_lora(policy, LoRAConfig(rank=4, alpha=8))
    load_global_adapters(lora, _random_b(lora))  # trained adapters: B != 0
    samples = [pack_pair(*completion_pair([1, 2, 3], [4, 5, 6, 7], [8, 9]), 23, 0),
               pack_pair(*completion_pair([9, 8], [7, 6, 5], [4, 3, 2, 1, 5]), 23, 0)]
    tokens, mask, docs = (torch.stack([s[i] for s in samples]) for i in range(3))
    batch = prepare_batch(tokens, assistant_mask=mask, documents=docs)
    policy.train()
    chosen, rejected = base_log_probs(policy, batch)
    expected = reference_log_probs(base, batch)
    assert torch.equal(chosen, expected[0]) and torch.equal(rejected, expected[1])
    assert policy.training  # its mode is restored
    adapted = reference_log_probs(policy, batch)  # the adapters are on again afterwards, and do change the output
    assert (adapted[0] - chosen).abs().max() > 1e-4
    with pytest.raises(ValueError, match="no LoRA adapter is hooked onto this model"):
        with adapters_disabled(base):
            pass


def test_offload_reference_is_refused_under_lora(tmp_path):
    from megalite.rlhf.preference_training import PreferenceTraining, add_preference_flags
    from megalite.training.flags import parse_args

    args = parse_args(dpo_argv(tmp_path, tmp_path, "--lora-rank", "4", "--offload-reference"), add_preference_flags)
    with pytest.raises(ValueError, match="--offload-reference: under --lora-rank the reference is the frozen base"):
        PreferenceTraining().prepare_data(args)


def test_peft_export_refuses_what_is_not_an_adapter_checkpoint(tmp_path, capsys):
    """One error line and exit status 2 for a source other than megalite and for adapters converted as a model;
    a base (not adapter) checkpoint given to the PEFT export is refused before anything is written."""
    from megalite.cli import run_cli
    from megalite.lora.peft import convert_adapters_to_peft
    from megalite.training.flags import parse_args

    assert run_cli(_convert, "--from", "hf", "--to", "peft", "--input", str(tmp_path), "--output",
                   str(tmp_path / "out")) == 2
    assert capsys.readouterr().err == "error: --from hf --to peft: one side must be megalite (convert in two steps)\n"
    _save_base(parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                           "--seq-length", "8", "--vocab-size", "32"]), tmp_path / "base")
    with pytest.raises(ValueError, match="is not a LoRA adapter checkpoint"):
        convert_adapters_to_peft(str(tmp_path / "base"), str(tmp_path / "peft"))
    assert not os.path.exists(tmp_path / "peft")
    # And the other way round: adapters given where a model is converted.
    from megalite.lora import LoRAConfig, apply_lora
    from megalite.lora.state import save_adapters
    from megalite.models import GPTModel
    from megalite.training.flags import gpt_config

    model = GPTModel(gpt_config(parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                                            "--seq-length", "8", "--vocab-size", "32"])))
    save_adapters(str(tmp_path / "adapters"), 1, apply_lora(model, LoRAConfig(rank=2)))
    assert run_cli(_convert, "--from", "megalite", "--to", "hf", "--input", str(tmp_path / "adapters"), "--output",
                   str(tmp_path / "hf")) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'adapters'} holds LoRA adapters, not a model: write them "
                                       "with --to peft (and convert the base model they were trained on with --to "
                                       "hf)\n")
