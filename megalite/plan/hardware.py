"""Hardware profiles: peak FLOP/s, memory, and link bandwidth/latency of one accelerator and its node.

Each profile is a small JSON file in ``megalite/plan/hardware/`` (``h100``, ``h200``, ``a100-80gb``,
``b200``, ``cpu``) or any path given on the command line; ``--calibrate`` writes one measured here.
``efficiency`` is the fraction of the peak the model's GEMMs reach (calibrated on the machine, or set
from published runs for the GPU profiles).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")


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


def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (see :func:`profile_names`) or JSON path; ValueError naming the known ones."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(PROFILE_DIR, name_or_path + ".json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown hardware profile {name_or_path!r}; known: {', '.join(profile_names())} "
                         f"(or a .json path)")
    with open(path) as f:
        data = json.load(f)
    return Hardware(**data)


def save_hardware(hardware: Hardware, path: str) -> None:
    with open(path, "w") as f:
        json.dump(vars(hardware), f, indent=1)
        f.write("\n")
