"""Megatron-LM's optimizer state in megalite's terms, for both Megatron checkpoint readers.

megalite's optimizer (:mod:`megalite.optim`) keeps two AdamW parameter groups, decayed then undecayed (biases
and 1-D parameters), and stores its state as global tensors ``optimizer.<exp_avg|exp_avg_sq|main>.<name>`` beside
a JSON entry (``num_steps``, ``scaler``, ``param_groups``).  Megatron-Core's default groups are the same ones
(one per weight-decay multiplier 1 and 0); its FP32 and mixed-precision optimizers save in ``torch_dist`` one
tensor per parameter and state key, ``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<parameter>`` in the
parameter's layout, and the step count and groups in ``common.pt`` (an MoE run at ep > 1 chains a second optimizer
for the experts: its keys start with ``chained_<k>.``, and its groups join megalite's when they train alike); the distributed optimizer's default
'dp_reshardable' layout is mapped onto the same names by :mod:`megalite.checkpoint.megatron_distopt`.  Anything
else (other groups, the distributed optimizer's other layouts) cannot be resumed: the reason becomes one warning
line (:func:`optimizer_warning`) and training starts with fresh Adam moments.
"""

from __future__ import annotations

import re

import torch

OPTIMIZER_STATE = "optimizer.state."
_CHAINED = re.compile(r"^chained_\d+\.")
# Megatron-Core's per-parameter state keys and megalite's names of them.
OPTIMIZER_STATE_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "main"}


def megalite_optimizer_prefix(key: str) -> tuple[str | None, str]:
    """``(megalite's prefix, the parameter's Megatron name)`` of Megatron's tensor ``key``
    ``optimizer.state.<state key>.<parameter>``, e.g. ``("optimizer.main.", "output_layer.weight")`` for
    ``optimizer.state.fp32_param.output_layer.weight``; ``(None, key)`` for another optimizer tensor."""
    key = _CHAINED.sub("", key)
    kind, _, parameter = key[len(OPTIMIZER_STATE):].partition(".")
    if not key.startswith(OPTIMIZER_STATE) or kind not in OPTIMIZER_STATE_KEYS or not parameter:
        return None, key
    return f"optimizer.{OPTIMIZER_STATE_KEYS[kind]}.", parameter


def default_groups_problem(groups: list[dict]) -> str | None:
    """Why Megatron's optimizer parameter ``groups`` are not its default ones (one per weight-decay multiplier 1 and
    0, with biases and 1-D parameters undecayed, as megalite groups them), or None when they are."""
    if len({g.get("wd_mult", 1.0) for g in groups}) != len(groups) or any(
            g.get("wd_mult", 1.0) not in (0.0, 1.0) or g.get("lr_mult", 1.0) != 1.0 or g.get("is_expert_parallel")
            or g.get("is_decoupled_lr") for g in groups):
        return "its parameter groups are not Megatron's default ones (one per weight-decay multiplier)"
    return None


def optimizer_meta(groups: list[dict], num_steps: int) -> dict:
    """megalite's optimizer JSON state (``num_steps``, ``scaler``, ``param_groups``: decayed, then undecayed) of
    Megatron's default parameter ``groups`` after ``num_steps`` Adam steps."""
    by_mult = {g.get("wd_mult", 1.0): g for g in groups}
    param_groups = []
    for wd_mult in (1.0, 0.0):
        group = by_mult.get(wd_mult, groups[0])
        param_groups.append({"lr": group["lr"], "weight_decay": group["weight_decay"] * wd_mult,
                             "betas": list(group["betas"]), "eps": group["eps"], "wd_mult": wd_mult})
    return {"num_steps": num_steps, "scaler": None, "param_groups": param_groups}


def optimizer_warning(note: str) -> str:
    """The warning line for a Megatron-LM optimizer state that is not resumed, for the reason ``note``."""
    return (f"warning: the Megatron optimizer state is not read ({note}): training from this checkpoint starts with "
            "fresh Adam moments")


def parameter_name(name: str) -> str:
    """The parameter a megalite tensor name belongs to: ``name``, or the ``<name>`` of ``optimizer.<key>.<name>``."""
    return name.split(".", 2)[2] if name.startswith("optimizer.") else name


def resumable_optimizer(saved, shapes: dict[str, tuple[int, ...]]) -> tuple[dict | None, str | None]:
    """``(megalite's optimizer JSON state, None)`` when ``common.pt``'s ``optimizer`` entry ``saved`` and the tensors
    ``shapes`` (megalite names) hold Megatron-Core's Adam state of every parameter in a layout megalite reads;
    ``(None, why not)`` when an optimizer was saved but cannot be resumed; ``(None, None)`` when none was saved."""
    if saved is None:
        return None, None
    if isinstance(saved, dict) and "param_state_sharding_type" in saved:
        return None, (f"it is a distributed optimizer's state in the {saved['param_state_sharding_type']!r} "
                      "layout, which megalite does not read")
    inners = [saved.get("optimizer", saved) if isinstance(saved, dict) else None for saved in chain(saved)]
    if not all(isinstance(inner, dict) and isinstance(inner.get("param_groups"), list) for inner in inners):
        return None, "its common state holds no parameter groups (not Adam)"
    groups, problem = chain_groups(inners)
    if problem:
        return None, problem
    for name in (name for name in shapes if not name.startswith("optimizer.")):
        for key in ("exp_avg", "exp_avg_sq"):
            if shapes.get(f"optimizer.{key}.{name}") != shapes[name]:
                return None, f"it holds no {key} of {name} of the parameter's shape"
    steps = [(inner.get("state") or {}).get("common_step") for inner in inners]
    if not all(isinstance(step, torch.Tensor) and step.numel() == 1 and step.item() >= 1 for step in steps):
        return None, "its common state holds no Adam step count (common_step)"
    if len({step.item() for step in steps}) != 1:
        return None, f"its chained optimizers took different numbers of steps ({[s.item() for s in steps]})"
    return optimizer_meta(groups, int(steps[0].item())), None


def chain(saved) -> list:
    """The optimizers of Megatron-Core's ``ChainedOptimizer`` state: ``{0: ..., 1: ...}`` in ``common.pt``, a list
    ``[...]`` in a legacy ``model_optim_rng.pt`` (an MoE run at ep > 1 keeps its expert parameters in a second one),
    else ``[saved]``."""
    if isinstance(saved, list):
        return saved
    if isinstance(saved, dict) and saved and all(isinstance(k, int) for k in saved):
        return [saved[k] for k in sorted(saved)]
    return [saved]


def chain_groups(inners: list[dict]) -> tuple[list[dict], str | None]:
    """``(the groups of the chained inner optimizer states inners that are not expert-parallel, None)`` when all
    groups join megalite's two (:func:`default_groups_problem`, :func:`expert_groups_problem`), else
    ``(those groups, why not)``."""
    groups = [g for inner in inners for g in inner["param_groups"] if not g.get("is_expert_parallel")]
    return groups, default_groups_problem(groups) or expert_groups_problem(inners, groups)


def expert_groups_problem(inners: list[dict], groups: list[dict]) -> str | None:
    """Why the expert-parallel parameter groups of ``inners`` cannot join megalite's two groups: each must train
    like the other parameters of its weight-decay multiplier (``groups``), as megalite's optimizer trains them."""
    dense = {g.get("wd_mult", 1.0): g for g in groups}
    for group in (g for inner in inners for g in inner["param_groups"] if g.get("is_expert_parallel")):
        like = dense.get(group.get("wd_mult", 1.0))
        fields = ("lr", "weight_decay", "betas", "eps", "lr_mult", "is_decoupled_lr")
        if like is None or any(group.get(f) != like.get(f) for f in fields):
            return "its expert-parallel parameter groups train otherwise than the other parameters"
    return None
