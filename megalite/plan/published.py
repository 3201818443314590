"""Published training throughputs (``published.json``) beside the planner's prediction for each.

A row gives the model, the layout, the batch and the published figure: achieved TFLOP/s per GPU
counted with the source's own FLOPs formula (Megatron-LM SC 2021: ``96 B s l h^2 (1 + s/6h + V/16lh)``
per iteration, which includes the recomputed forward), or tokens/s per GPU.  The prediction's step
time is converted into the same unit, so the two are comparable as published.
"""

from __future__ import annotations

import json
import os

from megalite.hardware import load_hardware
from megalite.models.config import GPTConfig
from megalite.plan.estimate import estimate
from megalite.plan.layout import Layout

PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published.json")


def published_rows() -> list[dict]:
    with open(PUBLISHED) as f:
        return json.load(f)["rows"]


def sc21_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. (SC 2021), eq. 3: model FLOPs of one iteration with full activation recompute."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def predict(row: dict) -> tuple[float, float]:
    """``(predicted, published)`` in the row's unit."""
    seq, vocab = row["seq_length"], row["vocab_size"]
    config = GPTConfig(vocab_size=vocab, max_position_embeddings=seq, **row["model"])
    tp, pp = row["tp"], row["pp"]
    layout = Layout(tp=tp, pp=pp, dp=row["gpus"] // (tp * pp), precision=row["precision"],
                    recompute=row["recompute"], micro_batch_size=row["micro_batch_size"])
    est = estimate(config, layout, load_hardware(row["hardware"]), seq, row["global_batch_size"])
    if "achieved_tflops_per_gpu" in row:
        flops = sc21_flops_per_iteration(row["global_batch_size"], seq, config.num_layers, config.hidden_size, vocab)
        return flops / est.step_time_s / row["gpus"] / 1e12, float(row["achieved_tflops_per_gpu"])
    return est.tokens_per_s_per_gpu, float(row["achieved_tokens_per_s_per_gpu"])
