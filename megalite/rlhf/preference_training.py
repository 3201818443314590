"""Preference optimisation through :func:`megalite.training.pretrain`: pair data, flags and the forward step.

``--pref-data FILE.jsonl`` holds ``prompt``, ``chosen`` and ``rejected`` per line (each a string, or a list of
messages as TRL's conversational form); every pair is rendered with the chat template (see
:mod:`megalite.data.sft`) and packed into one sample with the shared prefix once
(:func:`megalite.rlhf.preference.pack_shared_pair`), split by ``--split`` into train/valid/test.  Without
context or pipeline parallelism each micro-batch is cut after its last labelled token (:func:`trim`), so rows
cost what their pairs hold, not ``--seq-length``.  The reference is a frozen copy of the policy's weights when training
starts (the ``--load``ed model), kept by :class:`~megalite.rlhf.reference.ReferenceModel` and run on the fly
before each micro-batch's policy forward (optionally parked in CPU memory with ``--offload-reference``).
With ``--pref-loss kto`` the file is unpaired, TRL's KTO form: ``prompt``, ``completion`` and a boolean ``label``
(desirable or not) per line.  Each sample's row holds its completion and, as a second document, its prompt with the
completion of the previous sample in its micro-batch (the first takes the last's), TRL's rotation for the KL
reference point (:class:`UnpairedDataset`).  Under ``--lora-rank`` only the adapters train and the reference is the policy's own frozen base with its
adapters disabled (:func:`megalite.lora.adapters_disabled`, as TRL does with PEFT), so no second copy exists.
"""

from __future__ import annotations

import torch

from megalite.data.sft import conversation_from_record, jsonl_records
from megalite.flags import Flag, FlagTable
from megalite.rlhf.preference import (LOSS_TYPES, REFERENCE_FREE, PreferenceConfig, pack_shared_pair, pack_unpaired,
                                      pair_log_probs)
from megalite.rlhf.preference import preference_forward_step
from megalite.rlhf.reference import ReferenceModel, lora_base
from megalite.data.gpt_dataset import split_documents
from megalite.training import gpt, sft

GROUP = "preference optimisation"
PREFERENCE_FLAGS = FlagTable((
    Flag("--pref-data", GROUP, required=True,
         help="jsonl with prompt, chosen and rejected per line (kto: prompt, completion and a boolean label)"),
    Flag("--pref-loss", GROUP, ("PreferenceConfig.loss_type",), choices=LOSS_TYPES),
    Flag("--beta", GROUP, ("PreferenceConfig.beta",), type=float),
    Flag("--pref-label-smoothing", GROUP, ("PreferenceConfig.label_smoothing",), type=float,
         help="conservative DPO / SimPO: the chance a preference label is flipped"),
    Flag("--simpo-gamma", GROUP, ("PreferenceConfig.simpo_gamma",), type=float, help="SimPO's target margin"),
    Flag("--kto-desirable-weight", GROUP, ("PreferenceConfig.desirable_weight",), type=float,
         help="KTO's weight on desirable completions' losses"),
    Flag("--kto-undesirable-weight", GROUP, ("PreferenceConfig.undesirable_weight",), type=float,
         help="KTO's weight on undesirable completions' losses"),
    Flag("--offload-reference", GROUP, default=False,
         help="keep the reference's weights in CPU memory (not with --lora-rank, whose reference is the base)"),
), configs=(PreferenceConfig,))


def add_preference_flags(parser):
    """``extra_args_provider`` of a preference run (with SFT's ``--chat-template``)."""
    PREFERENCE_FLAGS.add_to(parser)
    sft.SFT_FLAGS.add_to(parser, names=["--chat-template"])
    return parser


def _records(path: str) -> list:
    try:
        return list(jsonl_records(path))
    except OSError as err:
        raise ValueError(f"--pref-data: {err}") from None


def read_pairs(path: str) -> list[tuple[list[dict], list[dict]]]:
    """``(chosen conversation, rejected conversation)`` per jsonl line, checked (errors name file and line)."""
    pairs = []
    for where, record in _records(path):
        if isinstance(record, dict) and "label" in record and "completion" in record:
            raise ValueError(f"{where}: an unpaired (KTO) record: use --pref-loss kto, or give 'chosen' and "
                             f"'rejected'")
        if not isinstance(record, dict) or not {"prompt", "chosen", "rejected"} <= set(record):
            raise ValueError(f"{where}: needs 'prompt', 'chosen' and 'rejected'")
        if record["chosen"] == record["rejected"]:
            raise ValueError(f"{where}: the chosen completion equals the rejected one, so the pair says nothing")
        pairs.append(tuple(conversation_from_record({"prompt": record["prompt"], "completion": record[key]}, where)
                           for key in ("chosen", "rejected")))
    if not pairs:
        raise ValueError(f"{path} holds no preference pairs")
    return pairs


def read_unpaired(path: str) -> list[tuple[dict, bool]]:
    """``(record, desirable)`` per jsonl line of KTO data (``prompt``, ``completion``, boolean ``label``), checked."""
    out = []
    for where, record in _records(path):
        if isinstance(record, dict) and {"chosen", "rejected"} <= set(record):
            raise ValueError(f"{where}: a paired record (chosen and rejected): --pref-loss kto takes unpaired "
                             f"'prompt', 'completion' and 'label'")
        if not isinstance(record, dict) or not {"prompt", "completion", "label"} <= set(record):
            raise ValueError(f"{where}: --pref-loss kto needs 'prompt', 'completion' and 'label' per line")
        if not isinstance(record["label"], bool):
            raise ValueError(f"{where}: 'label' must be true (desirable) or false, got {record['label']!r}")
        conversation_from_record(record, where)
        out.append(({"prompt": record["prompt"], "completion": record["completion"]}, record["label"]))
    if not out:
        raise ValueError(f"{path} holds no KTO samples")
    return out


class UnpairedDataset:
    """KTO rows ``{"tokens", "assistant_mask", "document_ids", "desirable"}`` (:func:`pack_unpaired`), repeated to
    ``num_samples``.  The sampler's micro-batches are aligned runs of ``micro_batch_size`` indices; within each,
    a sample's mismatched completion is the previous index's (the first takes the last's), as TRL's KTOTrainer
    rotates completions within a device batch, so the KL estimate uses the batch's own completions."""

    packed_documents = True

    def __init__(self, samples, renderer, seq_length: int, num_samples: int, micro_batch_size: int):
        self.records, self.renderer, self.seq_length = samples, renderer, seq_length
        self.num_samples, self.micro_batch_size = num_samples, micro_batch_size
        self.rows = {}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index - index % self.micro_batch_size
        other = start + (index - start - 1) % self.micro_batch_size
        i, j = index % len(self.records), other % len(self.records)
        if (i, j) not in self.rows:
            record = self.records[i][0]
            mismatched = {"prompt": record["prompt"], "completion": self.records[j][0]["completion"]}
            self.rows[i, j] = pack_unpaired(*(self.renderer.render(conversation_from_record(r))
                                              for r in (record, mismatched)),
                                            self.seq_length, self.renderer.tokenizer.pad)
        tokens, mask, docs = self.rows[i, j]
        return {"tokens": tokens, "assistant_mask": mask, "document_ids": docs,
                "desirable": torch.tensor(self.records[i][1])}


class PairDataset:
    """Packed pairs ``{"tokens", "assistant_mask", "document_ids"}`` with the shared prefix once (also for a
    sliding-window model: its window measures distance along each sequence), repeated to ``num_samples``."""

    packed_documents = True

    def __init__(self, pairs, renderer, seq_length: int, num_samples: int):
        self.samples = [pack_shared_pair(*(renderer.render(c) for c in pair), seq_length, renderer.tokenizer.pad)
                        for pair in pairs]
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, mask, docs = self.samples[index % len(self.samples)]
        return {"tokens": tokens, "assistant_mask": mask, "document_ids": docs}


class PreferenceTraining:
    """The providers of one run: ``prepare_data``, ``datasets`` and ``forward_step`` (see the module docstring)."""

    def __init__(self):
        self.args = None
        self.reference = None

    def prepare_data(self, args) -> None:
        if args.lora_rank is not None and args.offload_reference:
            raise ValueError("--offload-reference: under --lora-rank the reference is the frozen base with its "
                             "adapters disabled; there is no copy to offload")
        if args.pref_loss != "kto":
            read_pairs(args.pref_data)
        elif args.micro_batch_size < 2:
            raise ValueError("--pref-loss kto estimates its KL reference point from the other samples of a "
                             "micro-batch: use --micro-batch-size 2 or more")
        else:
            read_unpaired(args.pref_data)
        sft.check_chat_tokenizer(args)

    def datasets(self, args, num_samples):
        self.args = args
        renderer = sft.renderer_from_args(args)
        kto = args.pref_loss == "kto"
        pairs = read_unpaired(args.pref_data) if kto else read_pairs(args.pref_data)
        out = []
        for indices, wanted in zip(split_documents(len(pairs), args.split), num_samples):
            if not wanted or not len(indices):
                out.append(None)
            elif kto:
                out.append(UnpairedDataset([pairs[i] for i in indices], renderer, args.seq_length, int(wanted),
                                           args.micro_batch_size))
            else:
                out.append(PairDataset([pairs[i] for i in indices], renderer, args.seq_length, int(wanted)))
        return tuple(out)

    def forward_step(self, data_iterator, model):
        from megalite import topology

        args, topo = self.args, topology.current()
        config = PreferenceConfig(**PREFERENCE_FLAGS.config_values(args, "PreferenceConfig"))
        device = next(model.parameters()).device
        batch = {key: value.to(device) for key, value in next(data_iterator).items()}
        if topo.cp.size == 1 and topo.pp.size == 1:
            batch = trim(batch, 8 * topo.tp.size)
        if config.loss_type not in REFERENCE_FREE:
            if topo.pp.size > 1:
                raise ValueError("the on-the-fly reference runs a whole model: use --pipeline-model-parallel-size 1")
            if args.lora_rank is not None:
                chosen, rejected = base_log_probs(model, batch, topo.cp.group)
            else:
                if self.reference is None:
                    fresh = gpt.model_provider(args, pre_process=True, post_process=True,
                                               layer_range=(0, args.num_layers))
                    fresh.to(device)
                    self.reference = ReferenceModel(fresh, source=model, offload=args.offload_reference)
                with self.reference.on_device() as ref:
                    chosen, rejected = reference_log_probs(ref, batch, topo.cp.group)
            batch = {**batch, "ref_chosen": chosen, "ref_rejected": rejected}
        return preference_forward_step(config, topo.cp.group, topo.dp.group)(iter([batch]), model)


def trim(batch: dict, multiple: int) -> dict:
    """A one-rank (no CP, no pipeline) ``prepare_batch`` micro-batch cut after its last labelled token, rounded up
    to ``multiple`` tokens (sequence parallelism splits the rows over TP).  Exact: attention is causal, so the
    tokens cut change no labelled token's log-prob."""
    seq = batch["tokens"].shape[1]
    labelled = batch["loss_mask"].any(0).nonzero()
    end = int(labelled[-1]) + 1 if len(labelled) else 1
    end = min(seq, -(-end // multiple) * multiple)
    return {key: value[:, :end] if value.dim() == 2 and value.shape[1] == seq else value
            for key, value in batch.items()}


@torch.no_grad()
def reference_log_probs(reference, batch: dict, cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed chosen and rejected completion log-probs ``[b]`` of a whole (unpipelined) model chunk on a
    packed-pairs micro-batch (``prepare_batch``'s output)."""
    log_probs = -reference(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                           document_ids=batch["document_ids"])
    chosen, rejected, _, _ = pair_log_probs(log_probs, batch["loss_mask"], batch["document_ids"], cp_group)
    return chosen, rejected


def base_log_probs(model, batch: dict, cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_log_probs` of a LoRA policy's frozen base (:func:`megalite.rlhf.reference.lora_base`)."""
    with lora_base(model) as base:
        return reference_log_probs(base, batch, cp_group)

