"""Draw a pipeline timeline as a Gantt chart, write a Chrome/Perfetto trace, print the measured bubble.

Usage: python tools/plot_pipeline.py TIMELINE.json|DIR [...] [--iteration N] [--output gantt.png]
                                     [--trace trace.json]

Each input is a PipelineRecorder.save() file (one per rank; a directory means
every *.json in it), e.g. from ``--timeline-dir``.  The chart (matplotlib, the
``[plot]`` extra) shows one iteration (``--iteration``, default the last): one
lane per pipeline stage, time in ms, forward / input-gradient / weight-gradient
passes in their colours (a lighter shade for a rank's second model chunk), the
micro-batch number in each box, and the measured bubble in the title.  The
trace (``--trace``, default next to the PNG) holds every rank's ops of every
iteration; open it in chrome://tracing or https://ui.perfetto.dev to zoom in.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from megalite.cli import run_cli
from megalite.flags import ArgumentParser
from megalite.pipeline.timeline import PipelineRecorder, bubble_fraction

COLORS = {"F": "#3b6fc4", "B": "#3c9a50", "W": "#e08a2c"}
NAMES = {"F": "forward (F)", "B": "backward, input grad (B)", "W": "backward, weight grad (W)"}
LIGHTER = 0.45  # blend towards white for chunk 1, 2, ...


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


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = min(chunk * LIGHTER, 0.8)
    return tuple(c + (1 - c) * mix for c in rgb)


def plot(recorders: list[PipelineRecorder], path: str, title: str) -> None:
    """Write the Gantt chart of ``recorders`` (one iteration each, sorted by stage) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    begin = min(e[3] for r in recorders for e in r.events)
    span_ms = (max(e[4] for r in recorders for e in r.events) - begin) * 1e3
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(recorders) + 1.6))
    for lane, recorder in enumerate(recorders):
        for kind, microbatch, chunk, start, stop in recorder.events:
            left, width = (start - begin) * 1e3, (stop - start) * 1e3
            ax.barh(lane, width, left=left, height=0.8, color=_shade(COLORS.get(kind, "#888888"), chunk),
                    edgecolor="black", linewidth=0.4)
            if width > span_ms / 150:
                ax.text(left + width / 2, lane, str(microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(recorders)))
    ax.set_yticklabels([f"stage {r.stage}" for r in recorders])
    ax.invert_yaxis()
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    kinds = [k for k in COLORS if any(e[0] == k for r in recorders for e in r.events)]
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in kinds]
    if any(e[2] > 0 for r in recorders for e in r.events):
        handles.append(Patch(color=_shade("#777777", 1), label="lighter: second model chunk"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(recorders) < 4 else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chrome_trace(recorders: list[PipelineRecorder]) -> dict:
    """Every rank's ops as Chrome trace events (one thread per stage, times in microseconds)."""
    begin = min(e[3] for r in recorders for e in r.events)
    events = []
    for recorder in recorders:
        tid = recorder.stage if recorder.stage is not None else -1
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"stage {tid}"}})
        starts = set(recorder.iterations)
        iteration = -1
        for index, (kind, microbatch, chunk, start, stop) in enumerate(recorder.events):
            iteration += index in starts
            events.append({"name": f"{kind}{microbatch}", "cat": kind, "ph": "X", "pid": 0, "tid": tid,
                           "ts": (start - begin) * 1e6, "dur": (stop - start) * 1e6,
                           "args": {"microbatch": microbatch, "chunk": chunk, "iteration": iteration}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timelines", nargs="+", help="PipelineRecorder JSON files or directories of them")
    parser.add_argument("--iteration", type=int, default=-1, help="iteration to draw, 0-based (default: the last)")
    parser.add_argument("--output", default="pipeline_gantt.png", help="the Gantt chart to write (default: %(default)s)")
    parser.add_argument("--trace", default=None, help="Chrome trace JSON (default: OUTPUT with .trace.json)")
    args = parser.parse_args(argv)
    recorders = load_all(args.timelines)
    chosen = [r.iteration(args.iteration) for r in recorders if r.events]
    bubble = bubble_fraction(chosen)
    schedule = next((r.schedule for r in recorders if r.schedule), None) or "pipeline"
    count = len(recorders[0].iterations)
    shown = args.iteration % count
    try:
        plot(chosen, args.output, f"{schedule}, {len(chosen)} stages, iteration {shown} of {count}: "
                               f"measured bubble {bubble:.1%}")
    except ImportError:
        print("error: drawing needs matplotlib: pip install 'megalite[plot]'", file=sys.stderr)
        return 1
    trace = args.trace or os.path.splitext(args.output)[0] + ".trace.json"
    with open(trace, "w") as f:
        json.dump(chrome_trace(recorders), f)
    print(f"wrote {args.output} (iteration {shown}) and {trace} ({sum(len(r.events) for r in recorders)} ops)")
    print(f"bubble fraction: {bubble:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
