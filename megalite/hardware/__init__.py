"""Hardware profiles: peak FLOP/s, memory, and link bandwidth/latency of one accelerator and its node.

The one peak-FLOP table: the trainer's MFU (:func:`detect` picks the running GPU's profile) and the
planner (``python -m megalite.plan --hardware NAME``) both read it.  Each profile is a small JSON file in
``megalite/hardware/`` (``h100``, ``h200``, ``a100-80gb``, ``b200``, ``cpu``; ``h100-hbm2e-500w``, the parts of
torchtitan's published H100 runs) or any path given on the command line; the planner's ``--calibrate`` writes
one measured here.  ``efficiency`` is the fraction of
the peak the model's large GEMMs reach (calibrated on the machine, or set from measured runs for the GPU
profiles); ``gemm_half_rows`` the GEMM row count (tokens of one micro-batch on a rank) at which they reach
half of that, so smaller micro-batches run slower (0: no dependence on the shape); ``device_names`` are
fragments of ``torch.cuda.get_device_name()`` that mean this accelerator.

The work that is not a GEMM has rates of its own: ``attention_efficiency`` is the fraction of the peak the fused
causal attention (forward and backward, its FLOPs counted as :func:`~megalite.models.config.gpt_flops_per_token`
counts them) reaches (None: that of large GEMMs, as on the GPUs' flash kernels) and ``attention_score_s`` what each
of its scores costs beyond that (the softmax's work, forward and backward, per query and key of a head, counted over
the whole square as the FLOPs are; 0 on the GPU profiles); ``hbm_bandwidth`` prices the
memory-bound ops (norms, activations, residual adds, copies, the loss, gradient accumulation, the optimizer);
``op_overhead_s`` is the time each op adds beyond its work (eager dispatch and autograd on a CPU; the exposed part
of a kernel launch on a GPU).  ``exp_rate`` is the fp32 elements per second an exponential runs at, reading and
writing them (context parallelism's blockwise score tiles, the activation function's erf, tanh or sigmoid and the
loss's exponentials; None: at ``hbm_bandwidth``, as on a GPU, whose special function units keep up with its
memory).  ``collective_cpu`` maps each collective a step runs (``all_reduce``,
``all_gather``, ``reduce_scatter``, ``send_recv``) to the CPU a rank spends in one call (gloo's copies, reductions
and socket work) by the call's buffer bytes, as ``[[bytes, seconds], ...]`` points from 0 bytes up, priced between
them by straight lines and beyond the last by the last one's slope (gloo's cost per byte is far from constant: a
512 KiB all-reduce costs 2-3 times the per-byte rate of an 8 MiB one); a profile written before the table may
give ``[seconds per call, seconds per byte]`` instead, the straight line from 0 bytes.  ``collective_wait`` is the
same for the time a rank waits in a call beyond that CPU (for its partner and the link); both are measured at two
ranks as a step pays them, every core computing between the calls, and taken at no compute between them:
``collective_wait_per_compute`` is the seconds each call waits beyond that per second of compute since the rank's
previous call (the wait grows with the work between the calls), and ``collective_cpu_per_compute`` the CPU seconds
each call spends beyond it per second of that compute, up to ``collective_cpu_compute_s`` of it (a call after
27 ms of compute measured no more CPU than one after 6 ms); None or 0 where collectives do
not run on the cores that compute (a GPU's NCCL, whose time the link terms price).  ``cores`` is set where ranks share
CPU cores (the ``cpu`` profile): with more ranks than cores a step takes at least all ranks' work over the cores (None:
each rank has its own device).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

PROFILE_DIR = os.path.dirname(os.path.abspath(__file__))


def profile_names() -> list[str]:
    return sorted(name[:-5] for name in os.listdir(PROFILE_DIR) if name.endswith(".json"))


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict
    efficiency: float
    hbm_bytes: int
    hbm_bandwidth: float
    gpus_per_node: int
    intra_node_bandwidth: float
    intra_node_latency_s: float
    inter_node_bandwidth: float
    inter_node_latency_s: float
    source: str = ""
    device_names: tuple = ()
    gemm_half_rows: float = 0.0
    attention_efficiency: float | None = None
    attention_score_s: float = 0.0
    op_overhead_s: float = 0.0
    cores: int | None = None
    exp_rate: float | None = None
    collective_cpu: dict | None = None
    collective_wait: dict | None = None
    collective_wait_per_compute: float = 0.0
    collective_cpu_per_compute: float = 0.0
    collective_cpu_compute_s: float = 0.0

    def collective_cpu_s(self, op: str, buffer_bytes: float, calls: float, n: int) -> float:
        """CPU seconds a rank spends in ``calls`` collectives ``op`` over ``n`` ranks moving ``buffer_bytes`` in all
        (as :mod:`megalite.plan.traffic` counts them), from the two-rank calibration of ``collective_cpu``
        (:func:`_two_rank_costs_at`)."""
        return _two_rank_costs_at(self.collective_cpu, op, buffer_bytes, calls, n)

    def collective_wait_s(self, op: str, buffer_bytes: float, calls: float, n: int) -> float:
        """Seconds a rank waits in those collectives beyond their CPU, where every core computes, from the two-rank
        calibration of ``collective_wait`` (:func:`_two_rank_costs_at`)."""
        return _two_rank_costs_at(self.collective_wait, op, buffer_bytes, calls, n)

    def gemm_efficiency(self, rows: float) -> float:
        """Fraction of the peak reached by GEMMs of ``rows`` rows: ``efficiency * rows / (rows + gemm_half_rows)``,
        a fixed cost per GEMM (launch, tile edges) amortised over its rows."""
        return self.efficiency * rows / (rows + self.gemm_half_rows)

    def attention_rate(self, precision: str, rows: float) -> float:
        """FLOP/s of the fused causal attention's forward and backward at ``rows`` tokens per micro-batch."""
        if self.attention_efficiency is None:
            return self.peak(precision) * self.gemm_efficiency(rows)
        return self.peak(precision) * self.attention_efficiency

    def peak(self, precision: str) -> float:
        """Peak dense FLOP/s for ``precision`` (fp32 training runs at the fp32 peak)."""
        if precision not in self.peak_flops:
            raise ValueError(f"hardware profile {self.name!r} gives no peak for {precision}")
        return float(self.peak_flops[precision])

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a collective whose ranks lie within ``span`` consecutive ranks."""
        if span <= self.gpus_per_node:
            return self.intra_node_bandwidth, self.intra_node_latency_s
        return self.inter_node_bandwidth, self.inter_node_latency_s


def _per_call_s(points: list, nbytes: float) -> float:
    """Seconds of one call moving ``nbytes`` from a ``[[bytes, seconds], ...]`` table (or the legacy ``[seconds
    per call, seconds per byte]``): straight lines between the points, the last one's slope beyond them."""
    if not isinstance(points[0], (list, tuple)):
        per_call, per_byte = points
        points = [[0.0, per_call], [1.0, per_call + per_byte]]
    i = next((i for i in range(1, len(points) - 1) if nbytes <= points[i][0]), len(points) - 1)
    (b0, s0), (b1, s1) = points[i - 1], points[i]
    return s0 + (s1 - s0) * (nbytes - b0) / (b1 - b0)


def collective_runs(buffer_bytes: float, n: int) -> bool:
    """Whether a collective over ``n`` ranks moving ``buffer_bytes`` runs at all (one rank or no bytes: none)."""
    return n > 1 and buffer_bytes > 0


def _two_rank_costs_at(costs: dict | None, op: str, buffer_bytes: float, calls: float, n: int) -> float:
    """Seconds of ``calls`` collectives ``op`` over ``n`` ranks moving ``buffer_bytes`` in all, from ``costs``'
    two-rank table of ``op`` (see :class:`Hardware`) at each call's share of the bytes: its cost at 0 bytes per
    call and the rest per byte, of which a ring of ``n`` ranks moves ``2 (n-1) / n`` times the two ranks' and takes
    ``n - 1`` steps per call.  For ``send_recv`` the bytes and calls are the rank's sends, each matched by a receive
    of as much (its cost the two ranks' mean): twice the cost, whatever ``n``.  No bytes: no collective runs; no
    ``costs``: nothing is priced."""
    if costs is None or not collective_runs(buffer_bytes, n):
        return 0.0
    per_call = buffer_bytes / calls if calls > 0 else buffer_bytes
    fixed = _per_call_s(costs[op], 0.0)
    per_byte = (_per_call_s(costs[op], per_call) - fixed) / per_call  # the call's mean cost per byte
    if op == "send_recv":
        return 2 * (calls * fixed + buffer_bytes * per_byte)
    return calls * (n - 1) * fixed + 2 * (n - 1) / n * buffer_bytes * per_byte


def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (see :func:`profile_names`) or JSON path; ValueError naming the known ones."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(PROFILE_DIR, name_or_path + ".json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown hardware profile {name_or_path!r}; known: {', '.join(profile_names())} "
                         f"(or a .json path)")
    with open(path) as f:
        data = json.load(f)
    data["device_names"] = tuple(data.get("device_names", ()))
    return Hardware(**data)


def profile_for_device(device_name: str) -> Hardware | None:
    """The profile whose ``device_names`` has a fragment of ``device_name`` (a CUDA device name), or None."""
    for name in profile_names():
        hardware = load_hardware(name)
        if any(fragment in device_name for fragment in hardware.device_names):
            return hardware
    return None


def detect() -> Hardware | None:
    """The running GPU's profile; None on CPU or on a GPU no profile names."""
    import torch

    if not torch.cuda.is_available():
        return None
    return profile_for_device(torch.cuda.get_device_name())


def save_hardware(hardware: Hardware, path: str) -> None:
    with open(path, "w") as f:
        json.dump({**vars(hardware), "device_names": list(hardware.device_names)}, f, indent=1)
        f.write("\n")
