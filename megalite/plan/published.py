"""Published training throughputs (``published.json``) beside the planner's prediction for each.

A row gives the model, the layout, the batch and the published figure: achieved TFLOP/s per GPU
counted with the source's own FLOPs formula (Megatron-LM SC 2021: ``96 B s l h^2 (1 + s/6h + V/16lh)``
per iteration, which includes the recomputed forward), model FLOPs utilization (Korthikanti et al. 2022:
``72 B s l h^2 (1 + s/6h + V/12lh)`` over the peak), or tokens/s per GPU.  The prediction's step
time is converted into the same unit, so the two are comparable as published.  A row with ``"compile": false``
ran torchtitan's Llama in eager PyTorch: its memory-bound ops are torchtitan's unfused ones
(:mod:`megalite.plan.eager`), not megalite's.
"""

from __future__ import annotations

import json
import os

from megalite.hardware import load_hardware
from megalite.models.config import GPTConfig
from megalite.plan.eager import TORCHTITAN_EAGER
from megalite.plan.estimate import estimate
from megalite.plan.layout import Layout

PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published.json")


def published_rows() -> list[dict]:
    with open(PUBLISHED) as f:
        return json.load(f)["rows"]


def sc21_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. (SC 2021), eq. 3: model FLOPs of one iteration with full activation recompute."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def korthikanti_model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Korthikanti et al. (2022): model FLOPs of one iteration, no recompute counted (their MFU's numerator)."""
    return 72 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def _config(row: dict) -> GPTConfig:
    if "preset" in row:
        from megalite.plan.__main__ import preset_config

        return preset_config(row["preset"])
    return GPTConfig(vocab_size=row["vocab_size"], max_position_embeddings=row["seq_length"], **row["model"])


def predict(row: dict) -> tuple[float, float]:
    """``(predicted, published)`` in the row's unit."""
    seq, config = row["seq_length"], _config(row)
    tp, pp, cp = row["tp"], row["pp"], row.get("cp", 1)
    layout = Layout(tp=tp, pp=pp, cp=cp, dp=row["gpus"] // (tp * pp * cp), precision=row["precision"],
                    recompute=row["recompute"], micro_batch_size=row["micro_batch_size"],
                    fsdp=row.get("fsdp", False), sequence_parallel=row.get("sequence_parallel", False),
                    schedule=row.get("schedule"), vpp=row.get("vpp"), first_stage_layers=row.get("first_stage_layers"),
                    last_stage_layers=row.get("last_stage_layers"))
    hardware = load_hardware(row["hardware"])
    ops = TORCHTITAN_EAGER if row.get("compile") is False else None
    est = estimate(config, layout, hardware, seq, row["global_batch_size"], ops=ops)
    shape = (row["global_batch_size"], seq, config.num_layers, config.hidden_size, config.vocab_size)
    if "achieved_tflops_per_gpu" in row:
        return sc21_flops_per_iteration(*shape) / est.step_time_s / row["gpus"] / 1e12, \
            float(row["achieved_tflops_per_gpu"])
    if "achieved_mfu" in row:
        flops = korthikanti_model_flops_per_iteration(*shape)
        return flops / est.step_time_s / row["gpus"] / hardware.peak(row["precision"]), float(row["achieved_mfu"])
    return est.tokens_per_s_per_gpu, float(row["achieved_tokens_per_s_per_gpu"])
