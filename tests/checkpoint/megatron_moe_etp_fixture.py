"""A Megatron-Core MoE save whose experts are not tensor-parallel while the dense layers are (tp=2, ep=2,
``--expert-tensor-parallel-size 1``), in both formats, with Megatron-Core's logits of it.

On 2 CPU ranks Megatron-Core's rank order (``tp-cp-ep-dp-pp``) makes rank 0 tensor rank 0 and expert rank 0, and
rank 1 tensor rank 1 and expert rank 1, each the whole of its 2 experts (expert tensor rank 0): Megatron-LM's legacy
save writes ``mp_rank_00_000`` and ``mp_rank_01_001`` only.  No forward pass runs at tp=2 (Megatron-Core's MoE
trains only with sequence parallelism there, which its local layer spec's norms refuse): the moments come from one
step of Megatron-Core's Adam on seeded gradients, set to ``2 w + 1`` and ``w * w``
(:func:`megatron_legacy_fixture._adam`).
"""

from __future__ import annotations

import argparse
import os

import torch

EXPERT_TP = "_etp"
"""The suffix of the save directory of the expert-tensor-parallel run (torch_dist; + LEGACY: the legacy format)."""


def save_expert_tp(save_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """On this rank of 2: :mod:`megatron_moe_fixture`'s MoE GPT at tp=2, ep=2, expert_tensor_parallel_size 1, after
    Megatron-Core's Adam step, saved into ``save_dir + EXPERT_TP`` (torch_dist, the model) and ``save_dir +
    EXPERT_TP + LEGACY`` (``model_optim_rng.pt`` with the optimizer); returns Megatron-Core's logits of ``ids`` after
    its own load of the torch_dist save into a tp=1, ep=1 model."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.checkpoint import megatron_fixture, megatron_optim_fixture as run
    from tests.checkpoint.megatron_legacy_fixture import _adam, write_rank
    from tests.checkpoint.megatron_moe_fixture import ARGS, build, megatron_logits

    model = build(2, seed=3, tp=2, etp=1)
    optimizer = _adam(model)
    args = argparse.Namespace(**{**ARGS, "vocab_size": None, "consumed_train_samples": 0, "ckpt_format": "torch",
                                 "transformer_impl": "local"}, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=1, expert_model_parallel_size=2,
                              expert_tensor_parallel_size=1, world_size=2, data_parallel_size=1,
                              use_distributed_optimizer=False)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": run.SAVED_AT, "model": model.sharded_state_dict()}
    megatron_fixture.save_state(state, save_dir + EXPERT_TP, run.SAVED_AT)
    # Both ranks are the first of their expert data-parallel groups (of one rank): both write.
    legacy = save_dir + EXPERT_TP + run.LEGACY
    write_rank(legacy, model, optimizer, args, parallel_state.get_tensor_model_parallel_rank(), 0, 1, run.SAVED_AT,
               ep_rank=parallel_state.get_expert_model_parallel_rank())
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(legacy, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(run.SAVED_AT))
    parallel_state.destroy_model_parallel()
    return megatron_logits(save_dir + EXPERT_TP, ids)
