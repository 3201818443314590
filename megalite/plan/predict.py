"""The plan's prediction for a launched run's own layout, and the run's measurement beside it.

``examples/pretrain_gpt.py`` hands :func:`predict_run` to ``pretrain`` (``prediction_func``): at start rank 0
prints :meth:`RunPrediction.line` (memory per rank, step time, MFU for the layout the flags give, on the
running GPU's hardware profile, or the ``cpu`` profile without a GPU), and after warm-up
:meth:`RunPrediction.measured_line`, the measured figures with the prediction beside each, so every real run
checks (and can calibrate) the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.hardware import Hardware, detect, load_hardware
from megalite.models.config import gpt_flops_per_token
from megalite.plan.estimate import Estimate, estimate
from megalite.plan.layout import Layout
from megalite.plan.search import check_layout



def _size(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.2f} MiB"


@dataclass
class RunPrediction:
    """The estimate of one run (None with ``reason`` when the planner does not model it)."""

    hardware: Hardware | None
    estimate: Estimate | None = None
    flops_per_token: float = 0.0
    reason: str | None = None

    def line(self) -> str:
        if self.estimate is None:
            return f"plan: no prediction for this run: {self.reason}"
        est, mem = self.estimate, self.estimate.memory
        parts = ", ".join(f"{k} {_size(mem[k])}" for k in ("weights", "grads", "optimizer", "activations"))
        return (f"plan ({self.hardware.name}): memory {_size(mem['total'])} per rank ({parts}), "
                f"step {est.step_time_s:.4g} s, MFU {est.mfu:.1%}")

    def measured_line(self, seconds_per_iter: float, tokens_per_iter: float, peak_memory_bytes: int,
                      memory_kind: str) -> str:
        """The measured step time, peak memory (``memory_kind`` says what it counts) and MFU, each with the
        prediction beside it."""
        est = self.estimate
        world = est.layout.world
        mfu = tokens_per_iter / seconds_per_iter / world * self.flops_per_token / self.hardware.peak(
            est.layout.precision)
        return (f"measured after warm-up (plan): step {seconds_per_iter:.4g} s ({est.step_time_s:.4g} s), "
                f"memory {_size(peak_memory_bytes)} {memory_kind} ({_size(est.memory_total)}), "
                f"MFU {mfu:.1%} ({est.mfu:.1%})")


def predict_run(args, world: int) -> RunPrediction:
    """The plan's estimate of the run the pretraining flags ``args`` launch on ``world`` ranks."""
    from megalite.training.flags import gpt_config

    hardware = detect()
    if hardware is None:
        import torch

        if torch.cuda.is_available():
            return RunPrediction(None, reason=f"no megalite.hardware profile names {torch.cuda.get_device_name()}")
        hardware = load_hardware("cpu")
    if args.lora_rank:
        return RunPrediction(hardware, reason="the planner does not model LoRA fine-tuning (frozen base weights)")
    if args.pipeline_model_parallel_size > 1 and (args.pipeline_model_parallel_layout or (
            args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split)):
        return RunPrediction(hardware, reason="the planner does not model a split of given stage layer counts "
                             "(--pipeline-model-parallel-layout, --account-for-embedding/loss-in-pipeline-split)")
    config = gpt_config(args)
    if config.multi_latent_attention:
        return RunPrediction(hardware, reason="the planner does not model multi-latent attention")
    layout = Layout.from_args(args, world)
    reason = check_layout(config, layout, args.seq_length, args.global_batch_size)
    if reason is not None:
        return RunPrediction(hardware, reason=reason)
    est = estimate(config, layout, hardware, args.seq_length, args.global_batch_size)
    return RunPrediction(hardware, est, gpt_flops_per_token(config, args.seq_length))
