"""Turn a micro-batch of token samples into what one CP rank feeds the model.

A sample is ``S + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``).  Position
ids, document ids and the loss mask are derived from the whole sample (they
are small integer tensors), then each per-token field is cut to this rank's
load-balanced chunks, so no rank ever computes activations for the whole
sequence.  ``document_ids`` stays whole: attention looks up the documents of
the keys it receives from other ranks.
"""

from __future__ import annotations

import torch

from megalite.context_parallel.config import PackedSequenceConfig
from megalite.context_parallel.sequence_split import (check_context_parallel, document_ids, reset_position_ids, sees,
                                                     slice_for_rank)


def prepare_batch(tokens: torch.Tensor, packing: PackedSequenceConfig | None = None, cp: int = 1,
                  cp_rank: int = 0, assistant_mask: torch.Tensor | None = None,
                  documents: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``tokens [b, S+1]`` -> this rank's ``tokens``/``labels``/``loss_mask`` ``[b, S/cp]``, plus optional fields.

    Packed chat data (:mod:`megalite.data.sft`) gives its own ``documents [b, S+1]`` (a conversation's
    end-of-turn tokens do not end it) and ``assistant_mask [b, S+1]``: a label counts when it is an
    assistant token its input's document continues into (the same document and branch, or a branch off the
    input's trunk; see :mod:`sequence_split`); positions and attention follow those documents.

    ``position_ids [b, S/cp]`` comes with ``reset_position_ids``,
    ``document_ids [b, S]`` with ``reset_attention_mask``.
    ``loss_normalizer`` (a scalar) is the micro-batch's count of loss tokens
    divided by ``cp``: each rank divides its masked loss sum by it, so the
    mean over CP ranks is the micro-batch's mean loss over its loss tokens.
    """
    packing = packing or PackedSequenceConfig()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    check_context_parallel(seq, cp)
    loss_mask = torch.ones(inputs.shape, dtype=torch.float32, device=tokens.device)
    batch = {}
    if documents is not None:
        labelled = assistant_mask[:, 1:].bool() & sees(documents[:, 1:], documents[:, :-1])
        loss_mask = labelled.to(torch.float32)
        documents = documents[:, :-1].contiguous()
        batch["position_ids"] = slice_for_rank(reset_position_ids(documents), cp, cp_rank)
        batch["document_ids"] = documents
    elif packing.enabled:
        if packing.eod_token_id is None:
            raise ValueError("packed-sequence options need the end-of-document token id")
        documents = document_ids(inputs, packing.eod_token_id)
        if packing.eod_mask_loss:
            loss_mask[inputs == packing.eod_token_id] = 0.0
        if packing.reset_position_ids:
            batch["position_ids"] = slice_for_rank(reset_position_ids(documents), cp, cp_rank)
        if packing.reset_attention_mask:
            batch["document_ids"] = documents
    batch["loss_normalizer"] = (loss_mask.sum() / cp).clamp(min=1.0 / cp)
    batch["tokens"] = slice_for_rank(inputs, cp, cp_rank)
    batch["labels"] = slice_for_rank(labels, cp, cp_rank)
    batch["loss_mask"] = slice_for_rank(loss_mask, cp, cp_rank)
    return batch
