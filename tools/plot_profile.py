#!/usr/bin/env python
"""Draw a --profile trace's timeline as an SVG: one lane per part of the step time split.

    python tools/plot_profile.py checkpoints/trace-rank0.json --out docs/profile-ddp.svg

The lanes are the intervals tools/profile_split.py counts: data wait, compute,
communication overlapped with compute, exposed communication, optimizer; gray lines mark the step
boundaries. Plain SVG written by hand: no plotting library needed.
"""
import argparse
from pathlib import Path

from profile_split import read_trace, step_split  # beside this file: the split start.sh reports, not a copy

LANES = [("data_wait", "data wait", "#8c6bb1"), ("compute", "compute", "#4c9be8"),
         ("comm_overlapped", "communication, overlapped", "#9fd39f"),
         ("comm_exposed", "communication, exposed", "#e8554c"), ("optimizer", "optimizer", "#f2b134")]
WIDTH, LEFT, LANE, TOP = 900, 190, 26, 40


def drawn(intervals, pixel):
    """The intervals as drawn: those less than half a pixel apart merged (a step has thousands of ops)."""
    merged = []
    for a, b in intervals:
        if merged and a - merged[-1][1] < pixel / 2:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return merged


def svg(parts, steps, intervals, title):
    start, end = intervals["step"][0][0], intervals["step"][-1][1]
    scale = (WIDTH - LEFT - 20) / (end - start)
    x = lambda t: LEFT + (t - start) * scale  # noqa: E731
    height = TOP + LANE * len(LANES) + 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" '
           'font-size="12">', f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="14">{title}: {steps} steps, {(end - start) / 1000 / steps:.1f} ms '
           'per step (wall clock)</text>']
    for row, (key, label, color) in enumerate(LANES):
        y = TOP + row * LANE
        share = parts[key] / parts["step"]
        out.append(f'<text x="10" y="{y + 16}">{label} {share:.0%}</text>')
        out += [f'<rect x="{x(a):.1f}" y="{y + 3}" width="{max((b - a) * scale, 0.5):.1f}" height="{LANE - 6}" '
                f'fill="{color}"/>' for a, b in drawn(intervals[key], 1 / scale)]
    bottom = TOP + LANE * len(LANES)
    for a, _ in intervals["steps"][1:]:
        out.append(f'<line x1="{x(a):.2f}" y1="{TOP}" x2="{x(a):.2f}" y2="{bottom}" stroke="#888" '
                   'stroke-dasharray="3,3"/>')
    out.append(f'<text x="{LEFT}" y="{bottom + 20}">0 ms</text>')
    out.append(f'<text x="{WIDTH - 20}" y="{bottom + 20}" text-anchor="end">{(end - start) / 1000:.0f} ms</text>')
    out.append(f'<text x="{LEFT}" y="{bottom + 40}" fill="#555">other (Python between ops, idle): '
               f'{parts["other"] / parts["step"]:.0%}; shares of the step time, each instant counted once</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a trace-rank<R>.json written by --profile")
    parser.add_argument("--out", type=Path, required=True, help="the SVG to write")
    parser.add_argument("--title", default=None, help="default: the trace's file name")
    args = parser.parse_args()
    events, _ = read_trace(args.trace)
    parts, steps, intervals = step_split(events, with_intervals=True)
    if not intervals["step"]:
        raise SystemExit(f"error: '{args.trace}' has no ProfilerStep events: pass a trace written by --profile")
    args.out.write_text(svg(parts, steps, intervals, args.title or args.trace.name))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
