"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Keys are PEFT's (``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``) for the Hugging
Face model :mod:`megalite.checkpoint.hf` converts a megalite model to; the module names and the row
split come from that converter's :func:`megalite_tensor_to_hf` (one mapping, applied to B as to a
weight).  megalite fuses layers PEFT keeps apart:

- export: a fused layer's one A is written as the lora_A of each of its HF modules (Llama's
  q/k/v_proj, gate/up_proj), and its B split by rows as their lora_B.  ``x -> B_q A x`` is exactly
  the q rows of ``B A x``, so PEFT computes what megalite does.
- import: when the HF modules of one fused layer share one A, it becomes that layer's A and their
  B rows are put back in place (absent modules get zero rows).  When they have different A's, the
  A's are stacked (rank ``n * r``) and each B fills its own columns: the same update, exactly.  All
  adapters then get the largest rank needed, padded with zero rows/columns, and alpha grows with
  the rank so ``alpha / rank`` (PEFT's scaling) is unchanged.

:func:`convert_adapters_to_peft` (``tools/convert_checkpoint.py --from megalite --to peft``) exports a
``--lora-rank`` run's adapter checkpoint, saved under any layout.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from megalite.checkpoint import global_shapes
from megalite.checkpoint.files import fresh_output, move_into_place
from megalite.checkpoint.hf import default_prefix, hf_family, megalite_tensor_to_hf
from megalite.lora.config import TARGETS, LoRAConfig
from megalite.lora.state import read_adapter_checkpoint

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _hf_pieces(model_config, module: str, b: torch.Tensor, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``(HF module name, rows of b)`` for the global megalite module ``module``."""
    return [(name[:-len(".lora_B")], rows)
            for name, rows in megalite_tensor_to_hf(model_config, f"{module}.lora_B", b, prefix)]


def _short(hf_module: str) -> str:
    """``self_attn.q_proj`` of ``model.layers.3.self_attn.q_proj``: the name PEFT's target_modules match."""
    parts = hf_module.split(".")
    index = next(i for i, p in enumerate(parts) if p.isdigit())
    return ".".join(parts[index + 1:])


def export_peft(output: str, lora_config: LoRAConfig, model_config, tensors: dict[str, torch.Tensor], *,
                prefix: str | None = None, base_model_name_or_path: str | None = None) -> None:
    """Write global adapter tensors (see :mod:`megalite.lora.state`) as a PEFT adapter directory."""
    family = hf_family(model_config)
    prefix = default_prefix(family) if prefix is None else prefix
    out, targets = {}, set()
    for name in sorted(tensors):
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[:-len(".lora_A.weight")]
        a = tensors[name]
        for hf_module, b in _hf_pieces(model_config, module, tensors[f"{module}.lora_B.weight"], prefix):
            out[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = a.clone()  # one copy per HF module
            out[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = b.contiguous()
            targets.add(_short(hf_module))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_config.rank,
              "lora_alpha": lora_config.alpha, "lora_dropout": lora_config.dropout,
              "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": family == "gpt2",
              "base_model_name_or_path": base_model_name_or_path, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    os.makedirs(output, exist_ok=True)
    save_file(out, os.path.join(output, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(output, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def convert_adapters_to_peft(path: str, output: str, *, base_model_name_or_path: str | None = None) -> None:
    """Write the adapter checkpoint ``path`` (:func:`megalite.lora.state.save_adapters`, e.g. a ``--lora-rank``
    run's ``--save``) as the PEFT adapter directory ``output``, for the Hugging Face model that
    ``convert_checkpoint.py --to hf`` makes of its base.  ``output`` must not exist or be empty."""
    lora_config, model_config, tensors = read_adapter_checkpoint(path)
    tmp = fresh_output(output)
    export_peft(tmp, lora_config, model_config, tensors, base_model_name_or_path=base_model_name_or_path)
    move_into_place(tmp, output)


def _read_peft_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{adapter_dir} has no {CONFIG_FILE}: not a PEFT adapter directory")
    with open(path) as f:
        config = json.load(f)
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} (only LORA)")
    for flag in ("use_rslora", "use_dora"):
        if config.get(flag):
            problems.append(f"{flag}=true")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r} (only 'none')")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            problems.append(f"a {pattern}")
    if config.get("modules_to_save"):
        problems.append("modules_to_save")
    if problems:
        raise ValueError(f"PEFT adapter {adapter_dir} is not supported: {', '.join(problems)}")
    return config


def import_peft(adapter_dir: str, model_config, *, prefix: str | None = None
                ) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """``(LoRAConfig, global adapter tensors)`` of a PEFT LoRA adapter for ``model_config``'s HF model.

    Raises ValueError for adapter kinds megalite does not run (DoRA, rsLoRA, biases, per-module ranks)
    or for keys that match no layer of the model.
    """
    peft_config = _read_peft_config(adapter_dir)
    prefix = default_prefix(hf_family(model_config)) if prefix is None else prefix
    saved = load_file(os.path.join(adapter_dir, WEIGHTS_FILE))
    shapes = global_shapes(model_config)
    rank = int(peft_config["r"])
    used, modules = set(), {}
    for layer in range(model_config.num_layers):
        for target in TARGETS:
            module = next(n[:-len(".weight")] for n in shapes
                          if n.startswith(f"decoder.layers.{layer}.") and n.endswith(f".{target}.weight"))
            rows = shapes[f"{module}.weight"][0]
            probe = torch.arange(rows, dtype=torch.float64).unsqueeze(1)
            blocks = []  # (A, [(global rows, B rows)])
            for hf_module, index in _hf_pieces(model_config, module, probe, prefix):
                key = f"{PEFT_PREFIX}{hf_module}"
                if f"{key}.lora_A.weight" not in saved:
                    continue
                a, b = saved[f"{key}.lora_A.weight"].float(), saved[f"{key}.lora_B.weight"].float()
                used.update((f"{key}.lora_A.weight", f"{key}.lora_B.weight"))
                place = index[:, 0].long()
                for block_a, parts in blocks:
                    if torch.equal(block_a, a):
                        parts.append((place, b))
                        break
                else:
                    blocks.append((a, [(place, b)]))
            if blocks:
                modules[module] = (target, rows, blocks)
    unknown = sorted(set(saved) - used)
    if unknown or not modules:
        raise ValueError(f"PEFT adapter {adapter_dir}: keys {unknown[:4] or '(none)'} match no layer of the "
                         f"model (expected e.g. {PEFT_PREFIX}{prefix}layers.0.self_attn.q_proj.lora_A.weight)")
    width = rank * max(len(blocks) for _, _, blocks in modules.values())
    tensors = {}
    for module, (_, rows, blocks) in modules.items():
        a_full = torch.zeros(width, blocks[0][0].shape[1])
        b_full = torch.zeros(rows, width)
        for k, (a, parts) in enumerate(blocks):
            a_full[k * rank:(k + 1) * rank] = a
            for place, b in parts:
                b_full[place, k * rank:(k + 1) * rank] = b
        tensors[f"{module}.lora_A.weight"] = a_full
        tensors[f"{module}.lora_B.weight"] = b_full
    targets = tuple(t for t in TARGETS if any(target == t for target, _, _ in modules.values()))
    for layer_module in [n[:-len(".weight")] for n in shapes if n.endswith(tuple(f".{t}.weight" for t in targets))]:
        if f"{layer_module}.lora_A.weight" not in tensors:
            raise ValueError(f"PEFT adapter {adapter_dir} adapts {layer_module.rsplit('.', 1)[-1]} in some layers "
                             f"but not in {layer_module}; megalite adapts a target in every layer")
    config = LoRAConfig(rank=width, alpha=float(peft_config["lora_alpha"]) * width / rank,
                        dropout=float(peft_config.get("lora_dropout", 0.0)), target_modules=targets)
    return config, tensors
