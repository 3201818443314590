"""Which model-parallel rank's copy of a parameter counts, for a norm, a checkpoint or a parameter count.

A parameter can exist as identical copies on several model-parallel ranks: one not split over
tensor parallelism (a layer norm, a row-parallel bias) on every TP rank (every expert-TP rank for
an expert parameter), and a word embedding tied to the output layer on the first and the last
pipeline stage.  Each such family of copies must count once: in the global gradient norm, in the
checkpoint's writers and in the printed parameter count.  :func:`counts_on_this_rank` is that rule;
data-parallel copies are the caller's concern (a gradient norm sees DP-reduced gradients, a writer
or a count takes DP rank 0).
"""

from __future__ import annotations


def counts_on_this_rank(param, tp_rank: int, expert_tp_rank: int, pp_rank: int) -> bool:
    """True when this rank's copy of ``param`` is the one that counts among its model-parallel copies.

    TP-split parameters (``tensor_model_parallel``) are distinct on every TP rank and all count; a
    TP-replicated one counts on TP rank 0 (expert-TP rank 0 for ``expert_parallel`` parameters, which
    are distinct per EP rank); a ``shared_embedding`` counts on the first pipeline stage only.
    ``*_rank`` are this rank's indices in those groups (0 without the group).
    """
    if getattr(param, "shared_embedding", False) and pp_rank != 0:
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    return (expert_tp_rank if getattr(param, "expert_parallel", False) else tp_rank) == 0
