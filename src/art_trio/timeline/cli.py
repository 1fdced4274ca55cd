"""`art-trio timeline LOG`: draw a recorded run as a PNG and write its Perfetto trace.

Examples::

    art-trio timeline run.jsonl                       # run.png beside the log
    art-trio timeline run.jsonl --png run.png --trace run.trace.json
    # then open run.trace.json at https://ui.perfetto.dev (or chrome://tracing)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .read import TimelineError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="art-trio timeline",
        allow_abbrev=False,
        description=(
            "Draw a run recorded by art_trio.timeline.record_timeline (or `art-trio simulate "
            "--timeline`): one lane per worker slot, rollouts coloured by fate, training calls "
            "and evals as bands, policy publishes as lines; and/or write the Trace Event JSON "
            "that Perfetto and chrome://tracing open."
        ),
    )
    parser.add_argument("log", type=Path, help="the event log (JSON Lines)")
    parser.add_argument(
        "--png", type=Path, default=None, help="the picture (default: LOG with .png)"
    )
    parser.add_argument(
        "--trace", type=Path, default=None, help="also write the Trace Event JSON here"
    )
    parser.add_argument("--title", default=None, help="the picture's title")
    parser.add_argument("--dpi", type=int, default=100, help="the picture's dots per inch")
    parser.add_argument(
        "--until",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end the time axis here (draw two runs to one scale to compare them)",
    )
    parser.add_argument(
        "--allow-empty",
        action="store_true",
        help="draw a run that trained no step (an error otherwise)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``art-trio timeline ARGS``."""
    args = build_parser().parse_args(argv)
    from .model import load_timeline
    from .trace import write_trace

    try:
        run = load_timeline(args.log, require_steps=not args.allow_empty)
    except TimelineError as exc:
        print(f"art-trio timeline: error: {exc}", file=sys.stderr)
        return 2
    png = args.png if args.png is not None else args.log.with_suffix(".png")
    from .draw import draw

    draw(run, png, title=args.title, dpi=args.dpi, until=args.until)
    print(f"Picture: {png}")
    if args.trace is not None:
        print(f"Trace: {write_trace(run, args.trace)} (open at https://ui.perfetto.dev)")
    return 0
