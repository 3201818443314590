"""Offline preference optimisation: DPO, IPO and SimPO losses on chosen/rejected pairs packed into one forward.

A pair is one sample, so one forward of the policy (and of the reference) gives both sequences' log-probs.
The trainer shares the prefix (:func:`pack_shared_pair`, as in Wang et al. 2024, "Accelerating Direct
Preference Optimization with Prefix Sharing"): the tokens the two sequences share (the prompt, and any start
the completions share) once, then the rest of chosen, then the rest of rejected, as two branches of one
document (see :mod:`megalite.context_parallel.sequence_split`): rejected sees the shared prefix and itself, not
chosen, and its positions continue from the prefix, so every log-prob is the one of the sequence run alone.
:func:`pack_pair` packs ``prompt + chosen`` and ``prompt + rejected`` as two documents instead
(:func:`megalite.data.sft.pack`).  The model's per-token loss is the vocab-parallel
cross entropy, so ``-loss`` is the token log-prob without gathering the vocabulary under TP; the sums over
each completion are taken per document (:func:`pair_log_probs`), and under context parallelism summed over
the CP ranks.

Losses (``h`` is the policy-minus-reference log-ratio margin, chosen minus rejected):

- ``dpo`` (Rafailov et al. 2023, eq. 7), with conservative label smoothing ``eps``:
  ``-(1-eps) log sigma(beta h) - eps log sigma(-beta h)``; rewards ``beta * (log pi - log pi_ref)``.
- ``ipo`` (Azar et al. 2023, eq. 17): ``(h' - 1/(2 beta))^2`` where ``h'`` uses log-ratios averaged over
  each completion's tokens (the length-normalised form the paper's results use, as TRL does).
- ``simpo`` (Meng et al. 2024, eq. 6), reference-free: rewards ``beta/|y| log pi(y|x)``, loss
  ``-(1-eps) log sigma(r_w - r_l - gamma) - eps log sigma(-(r_w - r_l - gamma))``.

KTO (Ethayarajh et al. 2024, eq. 8) is for unpaired data: each completion is desirable or not, and the
reference point ``z0`` is the policy-to-reference KL estimated on mismatched prompt/completion pairs (pack
them as the second document of the row, so :func:`pair_log_probs` gives both); see :func:`kto_loss`.

The reference log-probs are inputs: computed once up front and stored with the pairs, or on the fly by
a frozen reference model's forward under ``torch.no_grad()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from os.path import commonprefix

import torch
import torch.nn.functional as F

from megalite.context_parallel import slice_for_rank
from megalite.context_parallel.sequence_split import BRANCH
from megalite.data.sft import pack
from megalite.tensor_parallel.mappings import reduce_from_tensor_parallel_region
from megalite.training.trainer import LOSS_METRIC

LOSS_TYPES = ("dpo", "ipo", "simpo", "kto")
REFERENCE_FREE = ("simpo",)


@dataclass
class PreferenceConfig:
    """Which loss and its constants."""

    loss_type: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0  # conservative DPO / SimPO: the chance a label is flipped
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    desirable_weight: float = 1.0  # KTO's lambda_D (TRL's desirable_weight)
    undesirable_weight: float = 1.0  # KTO's lambda_U (TRL's undesirable_weight)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss type {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.beta <= 0:
            raise ValueError(f"beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ValueError(f"KTO's desirable and undesirable weights must be positive, got "
                             f"{self.desirable_weight} and {self.undesirable_weight}")


def _check_pair(chosen, rejected) -> None:
    if not any(chosen[1][1:]) or not any(rejected[1][1:]):
        raise ValueError("a preference pair needs a non-empty chosen and rejected completion")
    if list(chosen[0]) == list(rejected[0]):
        raise ValueError("the chosen completion equals the rejected one, so the pair says nothing")


def pack_pair(chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]], seq_length: int,
              pad_id: int):
    """``(tokens, completion_mask, document_ids)`` ``[seq_length + 1]`` from two ``(ids, completion_mask)``
    sequences (each the prompt then its completion, e.g. rendered by :class:`megalite.data.sft.ChatRenderer`):
    chosen is document 0, rejected document 1, then padding."""
    _check_pair(chosen, rejected)
    return _pack_two(chosen, rejected, seq_length, pad_id, "a preference pair", "prompt twice, chosen, rejected")


def pack_unpaired(completion: tuple[list[int], list[int]], mismatched: tuple[list[int], list[int]], seq_length: int,
                  pad_id: int):
    """A KTO row, :func:`pack_pair`'s layout: the sample's prompt and completion as document 0, its prompt with
    another sample's completion (the KL estimate's mismatched pair) as document 1, then padding.  The prompts
    differ between the two, so no prefix is shared."""
    if not any(completion[1][1:]) or not any(mismatched[1][1:]):
        raise ValueError("a KTO sample needs a non-empty completion")
    return _pack_two(completion, mismatched, seq_length, pad_id, "a KTO sample",
                     "prompt twice, its completion and a mismatched one")


def _pack_two(first, second, seq_length: int, pad_id: int, what: str, parts: str):
    need = len(first[0]) + len(second[0])
    if need > seq_length + 1:
        raise ValueError(f"{what} needs {need} tokens ({parts}), more than --seq-length + 1 = {seq_length + 1}")
    (sample,), _ = pack([first, second], seq_length, pad_id)
    return sample


def shared_prefix(sequences: list[tuple[list[int], list[int]]],
                  label_split: bool = True) -> tuple[list[int], list[int], list[int], int]:
    """``(tokens, mask, documents, trunk)`` of ``(ids, mask)`` sequences laid out in one row with the start they all
    share once (no padding): the trunk (document 0) holds the tokens (and mask values) they share but the last,
    then branch ``k + 1`` (document ids ``(k + 1) * BRANCH``) holds sequence ``k`` from that token on, its
    positions continuing from the trunk's (:func:`megalite.context_parallel.reset_position_ids`).

    The last shared token opens every branch because its label differs between the sequences (the row is the
    loss's input, labels in place).  With ``label_split=False`` the trunk holds every shared token instead and a
    branch only the sequence's own (possibly none): for callers that gather each sequence's outputs by position
    (the RL trainer's packed rows, :func:`megalite.rlhf.shared_groups.pack_rows`), where the last shared token's
    one output serves every sequence.  Without enough shared tokens for a trunk (two, or one without
    ``label_split``) the trunk is empty (``trunk == 0``) and sequence ``k`` is document ``k`` instead.  Input
    position ``i`` of sequence ``k`` lies at ``i`` in the row when ``i < trunk``, else at ``trunk + (the
    lengths of the branches before k) + i - trunk``.
    """
    # the first column where some sequence's id or mask differs (or the shortest ends); commonprefix compares
    # only the lexicographically first and last sequences, in C
    common = min(len(commonprefix([list(ids) for ids, _ in sequences])),
                 len(commonprefix([list(mask) for _, mask in sequences])))
    trunk = (common - 1 if common >= 2 else 0) if label_split else common
    tokens, mask = list(sequences[0][0][:trunk]), list(sequences[0][1][:trunk])
    docs = [0] * trunk
    for k, (ids, values) in enumerate(sequences):
        tokens += list(ids[trunk:])
        mask += list(values[trunk:])
        docs += [(k + 1) * BRANCH if trunk else k] * (len(ids) - trunk)
    return tokens, mask, docs, trunk


def pack_shared_pair(chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]], seq_length: int,
                     pad_id: int):
    """:func:`pack_pair`'s sample with the shared prefix once (:func:`shared_prefix`): document 0's trunk holds the
    tokens (and mask values) the two sequences share but the last, branch 1 chosen from that token on, branch 2
    rejected from it on (its positions restart there), then padding (document 1).

    The last shared token is in both branches because its label differs (the completions' first different
    tokens).  Without two shared tokens it is :func:`pack_pair`'s row.
    """
    _check_pair(chosen, rejected)
    tokens, mask, docs, trunk = shared_prefix([chosen, rejected])
    if not trunk:
        return pack_pair(chosen, rejected, seq_length, pad_id)
    need = len(tokens)
    if need > seq_length + 1:
        raise ValueError(f"a preference pair needs {need} tokens (the shared prefix once, then chosen and rejected), "
                         f"more than --seq-length + 1 = {seq_length + 1}")
    fill = seq_length + 1 - need
    tokens, mask, docs = tokens + [pad_id] * fill, mask + [0] * fill, docs + [1] * fill
    return tuple(torch.tensor(x, dtype=torch.long) for x in (tokens, mask, docs))


def completion_pair(prompt: list[int], chosen: list[int], rejected: list[int]):
    """Token-level pairs for :func:`pack_pair`: ``(prompt + completion, mask of the completion)`` twice."""
    return tuple((list(prompt) + list(c), [0] * len(prompt) + [1] * len(c)) for c in (chosen, rejected))


def pair_log_probs(per_token_log_probs: torch.Tensor, loss_mask: torch.Tensor, documents: torch.Tensor,
                   cp_group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed completion log-probs and token counts of the chosen and rejected documents, each ``[b]``.

    ``per_token_log_probs`` and ``loss_mask`` are this CP rank's ``[b, s/cp]`` (from ``prepare_batch``);
    ``documents`` is the whole ``[b, s]``, rows of :func:`pack_pair` or :func:`pack_shared_pair` (whose shared
    labels count for both).  Under CP the sums are added over the ranks (backward: each rank's tokens get the
    gradient of the whole sum).
    """
    cp = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
    rank = 0 if cp_group is None else torch.distributed.get_rank(cp_group)
    local = slice_for_rank(documents, cp, rank)
    shared = (documents >= BRANCH).any(-1, keepdim=True)
    sums = []
    for unshared, branch in ((local == 0, local == BRANCH), (local == 1, local == 2 * BRANCH)):
        weight = loss_mask * torch.where(shared, (local == 0) | branch, unshared)
        sums += [(per_token_log_probs * weight).sum(-1), weight.sum(-1)]
    stacked = torch.stack(sums)
    if cp > 1:
        stacked = reduce_from_tensor_parallel_region(stacked, cp_group)
    return stacked[0], stacked[2], stacked[1].detach(), stacked[3].detach()


def preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                    ref_rejected: torch.Tensor | None, config: PreferenceConfig,
                    chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None):
    """Per-pair losses ``[b]``, chosen and rejected rewards ``[b]`` (detached) from summed log-probs."""
    lengths = (chosen_lengths, rejected_lengths)
    if config.loss_type in ("ipo", "simpo") and any(n is None for n in lengths):
        raise ValueError(f"{config.loss_type} needs the completions' token counts")
    if config.loss_type in REFERENCE_FREE:
        chosen_rewards = config.beta * chosen / chosen_lengths
        rejected_rewards = config.beta * rejected / rejected_lengths
        logits = chosen_rewards - rejected_rewards - config.simpo_gamma
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"{config.loss_type} needs the reference model's log-probs")
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        chosen_rewards, rejected_rewards = config.beta * chosen_ratio, config.beta * rejected_ratio
        if config.loss_type == "ipo":
            margin = chosen_ratio / chosen_lengths - rejected_ratio / rejected_lengths
            return (margin - 1 / (2 * config.beta)) ** 2, chosen_rewards.detach(), rejected_rewards.detach()
        logits = config.beta * (chosen_ratio - rejected_ratio)
    eps = config.label_smoothing
    losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, policy_kl: torch.Tensor, reference_kl: torch.Tensor,
             desirable: torch.Tensor, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             dp_group=None):
    """KTO: per-sample losses ``[b]``, rewards ``beta * log-ratio`` ``[b]`` (detached) and ``z0``.

    ``policy``/``reference``: summed completion log-probs; ``policy_kl``/``reference_kl``: those of the
    mismatched completions; ``desirable`` a bool ``[b]``.  ``z0 = max(0, mean(policy_kl - reference_kl))``,
    detached and averaged over ``dp_group``; loss ``w_D (1 - sigma(beta (r - z0)))`` for a desirable
    completion, ``w_U (1 - sigma(beta (z0 - r)))`` for an undesirable one.
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    z0 = (policy_kl - reference_kl).detach().mean()
    if dp_group is not None and torch.distributed.get_world_size(dp_group) > 1:
        torch.distributed.all_reduce(z0, group=dp_group)
        z0 = z0 / torch.distributed.get_world_size(dp_group)
    z0 = z0.clamp(min=0)
    ratio = policy - reference
    desirable = desirable.bool()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio))))
    return losses, beta * ratio.detach(), z0


def preference_forward_step(config: PreferenceConfig, cp_group=None, dp_group=None):
    """A pipeline-schedule forward step (``forward_step(data_iterator, model)``) for preference pairs.

    Each micro-batch is ``prepare_batch``'s output for packed pairs plus ``ref_chosen``/``ref_rejected``
    ``[b]`` (the reference's summed log-probs, computed up front or by a reference forward just before;
    not needed by SimPO).  The last stage turns the per-token loss into the mean pair loss.  Under CP
    every rank holds the whole loss but only its tokens' gradient, which DDP averages over dp x cp, so
    the loss it backpropagates is multiplied by cp (the logged metrics are not).

    KTO's rows are :func:`pack_unpaired`'s (document 0 the completion, document 1 the mismatched one, whose
    reference sums come as ``ref_rejected``) with ``desirable`` ``[b]``; ``z0`` is averaged over ``dp_group``.
    """
    cp = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        device = next(model.parameters()).device
        batch = {key: value.to(device) for key, value in batch.items()}
        output = model(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                       document_ids=batch["document_ids"])

        def loss_func(per_token_loss):
            chosen, rejected, n_chosen, n_rejected = pair_log_probs(-per_token_loss.float(), batch["loss_mask"],
                                                                    batch["document_ids"], cp_group)
            if config.loss_type == "kto":
                losses, rewards, z0 = kto_loss(chosen, batch["ref_chosen"], rejected, batch["ref_rejected"],
                                               batch["desirable"], config.beta, config.desirable_weight,
                                               config.undesirable_weight, dp_group)
                return losses.mean() * cp, kto_metrics(losses, rewards, z0, batch["desirable"])
            losses, chosen_rewards, rejected_rewards = preference_loss(
                chosen, rejected, batch.get("ref_chosen"), batch.get("ref_rejected"), config, n_chosen, n_rejected)
            return losses.mean() * cp, preference_metrics(losses, chosen_rewards, rejected_rewards)

        return output, loss_func

    return forward_step


def preference_metrics(losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict:
    """The batch means logged per step: loss (as the trainer's loss), rewards, reward accuracy and margin."""
    return {LOSS_METRIC: losses.detach().mean(), "rewards_chosen": chosen_rewards.mean(),
            "rewards_rejected": rejected_rewards.mean(),
            "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
            "reward_margin": (chosen_rewards - rejected_rewards).mean()}


def kto_metrics(losses: torch.Tensor, rewards: torch.Tensor, z0: torch.Tensor, desirable: torch.Tensor) -> dict:
    """KTO's batch values logged per step: loss, the reference point ``kl`` (z0), and the mean rewards of the
    desirable and undesirable completions (0 where the micro-batch has none)."""
    desirable = desirable.bool()
    out = {LOSS_METRIC: losses.detach().mean(), "kl": z0}
    for name, which in (("rewards_desirable", desirable), ("rewards_undesirable", ~desirable)):
        out[name] = (rewards * which).sum() / which.sum().clamp(min=1)
    return out
