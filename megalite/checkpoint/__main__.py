"""``python -m megalite.checkpoint inspect DIR``: a checkpoint's layout, iteration, tensors and sizes."""

from __future__ import annotations

import math
import sys

from megalite.checkpoint.files import MANIFEST
from megalite.checkpoint.reader import open_reader
from megalite.cli import run_cli
from megalite.flags import ArgumentParser
from megalite.models.architecture import config_to_dict


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"


def describe(path: str) -> str:
    """The text that ``inspect`` prints for the checkpoint at ``path`` (every file is verified first): a megalite
    checkpoint, or a Megatron-LM torch_dist one (tensors under megalite's names)."""
    reader = open_reader(path)
    reader.verify_all()
    state = reader.state
    layout = ", ".join(f"{k}={v}" for k, v in reader.layout.items()) or "not recorded"
    lines = [f"checkpoint {reader.directory}", f"iteration {reader.iteration}, written by {reader.world_size} "
             f"rank(s); saved layout: {layout}"]
    if state.get("format") == "megatron_dist":
        lines.append("format: Megatron-LM torch_dist (Megatron-Core dist_checkpointing); every shard file present")
    else:
        lines.append(f"{len(reader.manifest['files'])} files, all match their sha256 in {MANIFEST}")
    saved = reader.config_dict if reader.config_dict is not None else config_to_dict(reader.config)
    if saved is not None:
        arch = ", ".join(f"{k}={v}" for k, v in saved.items() if v is not None)
        lines.append(f"architecture: {arch}")
    optimizer = state.get("optimizer")
    lines.append("optimizer: none" if optimizer is None else f"optimizer: {optimizer['num_steps']} steps taken")
    if state.get("consumed_samples") is not None:
        lines.append(f"consumed samples: {state['consumed_samples']}")
    rows, total = [], 0
    for name, shape in sorted(reader.shapes.items()):
        dtype = reader.dtype(name)
        nbytes = math.prod(shape) * dtype.itemsize
        total += nbytes
        text = "x".join(str(s) for s in shape) or "scalar"
        rows.append((name, text, str(dtype).replace("torch.", ""), str(len(reader.chunks(name))), _size(nbytes)))
    lines.append(f"{len(rows)} tensors, {_size(total)}:")
    widths = [max(len(r[i]) for r in rows) for i in range(5)] if rows else [0] * 5
    lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(("name", "shape", "dtype", "chunks", "size"), widths)))
    for row in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m megalite.checkpoint",
                                     description="Inspect a megalite or Megatron-LM (torch_dist) checkpoint.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print the layout, iteration, tensors and sizes")
    inspect.add_argument("directory", help="a save directory (its latest iteration) or an iteration directory")
    args = parser.parse_args(argv)
    print(describe(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
