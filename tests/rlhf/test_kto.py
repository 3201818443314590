"""KTO through the DPO example's data path: UnpairedDataset's rows (each completion, then a mismatched one rotated
within the micro-batch) and preference_forward_step's loss and gradients equal TRL's KTOTrainer._compute_loss on the
same sequences, and bad unpaired input fails with one clear line."""

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megalite.context_parallel import prepare_batch
from megalite.data.sampler import collate
from megalite.rlhf.preference import PreferenceConfig, pair_log_probs, preference_forward_step
from megalite.rlhf.preference_training import UnpairedDataset, read_pairs, read_unpaired
from tests.models.common import VOCAB
from tests.rlhf.test_preference import SEQ, _grads, _models

# (prompt, completion, desirable): prompts and completions are token ids written as text.
SAMPLES = [([5, 6, 7], [8, 9, 10, 11], True), ([20, 21], [22, 23], False), ([30, 31, 32, 33, 34], [35], True),
           ([40, 41], [42, 43, 44], True)]


class _IdRenderer:
    """A stand-in for the chat renderer: message contents are space-separated token ids, the assistant's masked."""

    tokenizer = SimpleNamespace(pad=0)

    def render(self, messages):
        ids, mask = [], []
        for message in messages:
            part = [int(t) for t in message["content"].split()]
            ids += part
            mask += [int(message["role"] == "assistant")] * len(part)
        return ids, mask


def _records():
    return [({"prompt": " ".join(map(str, p)), "completion": " ".join(map(str, c))}, label) for p, c, label in SAMPLES]


def _trl_loss(trl, model, ref_model, config):
    """TRL's KTOTrainer._compute_loss (eval mode, reference log-probs given as precomputed) on TRL's own collated
    batch; the KL completions rotated as KTOTrainer._prepare_dataset's add_kl_completion_ids does (its body, a
    nested function, restated: completion i-1 for prompt i, the first taking the last's)."""
    completions = [c for _, c, _ in SAMPLES]
    kl = [completions[-1]] + completions[:-1]
    examples = [{"prompt_ids": p, "completion_ids": c, "KL_completion_ids": k, "label": d}
                for (p, c, d), k in zip(SAMPLES, kl)]
    collator = trl.trainer.kto_trainer.DataCollatorForUnpairedPreference(pad_token_id=0)
    inputs = collator.torch_call(examples)

    def log_probs(m, input_ids, labels):
        """Per-token log-probs of the labelled tokens, each row run alone (right padding is after them)."""
        logits = m(input_ids)[:, :-1, :VOCAB].float()
        targets = labels[:, 1:]
        out = F.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return out * (targets != -100)

    def fake_model(m):
        def call(input_ids, labels, **_):
            lp = log_probs(m, input_ids, labels)
            return SimpleNamespace(log_probs=lp, entropy=torch.zeros_like(lp), mean_logits=torch.zeros_like(lp))
        return call

    with torch.no_grad():
        ref = fake_model(ref_model)
        inputs["ref_logps"] = ref(inputs["input_ids"], inputs["input_ids"].masked_fill(
            inputs["completion_mask"] == 0, -100)).log_probs.sum(-1)
        inputs["ref_KL_logps"] = ref(inputs["KL_input_ids"], inputs["KL_input_ids"].masked_fill(
            inputs["KL_completion_mask"] == 0, -100)).log_probs.sum(-1)
    accelerator = SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x)
    fake = SimpleNamespace(model=SimpleNamespace(training=False), accelerator=accelerator, aux_loss_enabled=False,
                           precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=config.beta,
                           desirable_weight=config.desirable_weight, undesirable_weight=config.undesirable_weight,
                           _metrics={"eval": defaultdict(list)}, _total_train_tokens=0)
    fake._compute_kl_logps = lambda m, batch: trl.KTOTrainer._compute_kl_logps(fake, m, batch)
    loss = trl.KTOTrainer._compute_loss(fake, fake_model(model), inputs, False)
    return loss, fake._metrics["eval"]["kl"][0]


def test_kto_equals_trl():
    trl = pytest.importorskip("trl")
    model, ref_model = _models()
    config = PreferenceConfig("kto", beta=0.7, desirable_weight=1.0, undesirable_weight=2.5)
    dataset = UnpairedDataset(_records(), _IdRenderer(), SEQ, num_samples=len(SAMPLES), micro_batch_size=len(SAMPLES))
    raw = collate([dataset[i] for i in range(len(SAMPLES))])
    batch = {**prepare_batch(raw["tokens"], assistant_mask=raw["assistant_mask"], documents=raw["document_ids"]),
             "desirable": raw["desirable"]}
    with torch.no_grad():
        log_probs = -ref_model(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                               document_ids=batch["document_ids"])
        ref, ref_kl, _, _ = pair_log_probs(log_probs, batch["loss_mask"], batch["document_ids"])
    batch.update(ref_chosen=ref, ref_rejected=ref_kl)
    output, loss_func = preference_forward_step(config)(iter([batch]), model)
    loss, metrics = loss_func(output)
    grads = _grads(model, loss)

    want, want_kl = _trl_loss(trl, model, ref_model, config)
    want_grads = _grads(model, want)
    assert want_kl > 0  # the reference point is not clamped away
    assert metrics["kl"].item() == pytest.approx(want_kl, rel=1e-5)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rows_rotate_within_micro_batches():
    """With micro-batches of 2, sample 1's KL completion is sample 0's and sample 0's is sample 1's; index 4 starts
    the next micro-batch (records wrap) and pairs with index 5."""
    dataset = UnpairedDataset(_records(), _IdRenderer(), SEQ, num_samples=8, micro_batch_size=2)

    def documents(index):
        row = dataset[index]
        tokens, docs = row["tokens"].tolist(), row["document_ids"].tolist()
        return [[t for t, d in zip(tokens, docs) if d == k] for k in (0, 1)], bool(row["desirable"])

    (p0, c0, _), (p1, c1, _) = SAMPLES[:2]
    assert documents(0) == ([p0 + c0, p0 + c1], True)
    assert documents(1) == ([p1 + c1, p1 + c0], False)
    assert documents(4) == documents(0) and documents(5) == documents(1)
    assert documents(3)[0] == [SAMPLES[3][0] + SAMPLES[3][1], SAMPLES[3][0] + SAMPLES[2][1]]


def test_bad_unpaired_input(tmp_path):
    path = tmp_path / "kto.jsonl"
    good = {"prompt": "hi", "completion": "hello.", "label": True}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "hi", "completion": "go away."}) + "\n")
    with pytest.raises(ValueError, match=r"kto.jsonl:2: --pref-loss kto needs 'prompt', 'completion' and 'label'"):
        read_unpaired(str(path))
    path.write_text(json.dumps({**good, "label": "yes"}) + "\n")
    with pytest.raises(ValueError, match=r"kto.jsonl:1: 'label' must be true \(desirable\) or false, got 'yes'"):
        read_unpaired(str(path))
    path.write_text(json.dumps({"prompt": "hi", "chosen": "hello.", "rejected": "go away."}) + "\n")
    with pytest.raises(ValueError, match=r"kto.jsonl:1: a paired record \(chosen and rejected\): --pref-loss kto"):
        read_unpaired(str(path))
    path.write_text(json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r"kto.jsonl:1: an unpaired \(KTO\) record: use --pref-loss kto"):
        read_pairs(str(path))
    assert read_unpaired(str(path)) == [({"prompt": "hi", "completion": "hello."}, True)]
    with pytest.raises(ValueError, match="KTO's desirable and undesirable weights must be positive"):
        PreferenceConfig("kto", undesirable_weight=0.0)
