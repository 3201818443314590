"""Draw pipeline timelines as a Gantt chart PNG and print the measured bubble fraction.

Usage: python tools/plot_pipeline.py TIMELINE.json|DIR [...] [--out gantt.png] [--width 1200]

Each input is a PipelineRecorder.save() file (one per rank; a directory means
every *.json in it).  One lane per pipeline stage, time left to right; forwards
are blue, backwards green, a lighter shade for each later model chunk, and odd
micro-batches slightly darker so neighbours stay distinguishable.  Idle time is
white.  The PNG is written with zlib + struct + numpy, no imaging library.
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import sys
import zlib

import numpy as np

from megalite.pipeline.timeline import PipelineRecorder, bubble_fraction

LANE, GAP, MARGIN = 24, 6, 10
BASE = {"F": np.array([60, 110, 200]), "B": np.array([60, 160, 80])}
IDLE, EDGE = np.array([255, 255, 255]), np.array([40, 40, 40])


def write_png(path: str, rgb: np.ndarray) -> None:
    """Write an [h, w, 3] uint8 image as an 8-bit RGB PNG."""
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
                + chunk(b"IEND", b""))


def color(kind: str, microbatch: int, chunk: int) -> np.ndarray:
    shade = BASE[kind] + chunk * 45 - (microbatch % 2) * 25
    return np.clip(shade, 0, 255)


def render(recorders: list[PipelineRecorder], width: int) -> np.ndarray:
    """The Gantt chart of ``recorders`` (sorted by stage) as an RGB array."""
    begin = min(s for r in recorders for _, _, _, s, _ in r.events)
    end = max(e for r in recorders for _, _, _, _, e in r.events)
    scale = (width - 2 * MARGIN) / max(end - begin, 1e-9)
    height = 2 * MARGIN + len(recorders) * LANE + (len(recorders) - 1) * GAP
    image = np.empty((height, width, 3), np.uint8)
    image[:] = IDLE
    for lane, recorder in enumerate(recorders):
        top = MARGIN + lane * (LANE + GAP)
        image[top - 1, MARGIN:width - MARGIN] = EDGE
        image[top + LANE, MARGIN:width - MARGIN] = EDGE
        for kind, microbatch, chunk, start, stop in recorder.events:
            x0 = MARGIN + int(round((start - begin) * scale))
            x1 = max(x0 + 1, MARGIN + int(round((stop - begin) * scale)))
            image[top:top + LANE, x0:x1] = color(kind, microbatch, chunk)
            image[top:top + LANE, x0] = EDGE
    return image


def load_all(paths: list[str]) -> list[PipelineRecorder]:
    files = []
    for path in paths:
        files.extend(sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path])
    if not files:
        raise ValueError(f"no timeline files found in {paths}")
    recorders = [PipelineRecorder.load(f) for f in files]
    if not any(r.events for r in recorders):
        raise ValueError(f"the {len(files)} timeline files hold no events")
    return sorted(recorders, key=lambda r: -1 if r.stage is None else r.stage)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timelines", nargs="+", help="PipelineRecorder JSON files or directories of them")
    parser.add_argument("--out", default="pipeline_gantt.png")
    parser.add_argument("--width", type=int, default=1200)
    args = parser.parse_args(argv)
    try:
        recorders = load_all(args.timelines)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_png(args.out, render(recorders, args.width))
    print(f"wrote {args.out}: {len(recorders)} stages, "
          f"{sum(len(r.events) for r in recorders)} ops (F blue, B green; lighter = later chunk)")
    print(f"bubble fraction: {bubble_fraction(recorders):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
