"""`art-trio timeline LOG`: draw a recorded run as a PNG and/or write its Perfetto trace.

Examples::

    art-trio timeline run.jsonl                       # run.png beside the log
    art-trio timeline run.jsonl --png run.png --trace run.trace.json
    art-trio timeline run.jsonl --trace run.trace.json  # the trace only (no matplotlib needed)
    # then open run.trace.json at https://ui.perfetto.dev (or chrome://tracing)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from art_trio.cli import int_at_least, number_in

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
            "that Perfetto and chrome://tracing open. With neither --png nor --trace, the "
            "picture is drawn to LOG with .png; with --trace alone, only the trace is written."
        ),
    )
    parser.add_argument("log", type=Path, help="the event log (JSON Lines)")
    parser.add_argument(
        "--png",
        type=Path,
        default=None,
        metavar="FILE",
        help="draw the picture (PNG) to exactly this file (default: LOG with .png, unless "
        "--trace is given)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the Trace Event JSON to this file (needs no matplotlib)",
    )
    parser.add_argument("--title", default=None, help="the picture's title")
    parser.add_argument(
        "--dpi", type=int_at_least(1), default=100, help="the picture's dots per inch"
    )
    parser.add_argument(
        "--until",
        type=number_in(0, low_open=True),
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
    try:
        _run(args)
    except TimelineError as exc:
        message = str(exc)
    except OSError as exc:  # an output: a name too long, a full disk (the log's are TimelineErrors)
        message = f"{exc.filename or 'an output'}: cannot be written ({exc.strerror or exc})"
    else:
        return 0
    print(f"art-trio timeline: error: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> None:
    from .draw import draw
    from .model import load_timeline, no_steps_error
    from .trace import write_trace

    png: Path | None = args.png
    if png is None and args.trace is None:
        png = args.log.with_suffix(".png")
    # Every output is checked before anything is read or written: a bad --trace must not be
    # found after the picture was drawn.
    _check_outputs(args.log, [p for p in (png, args.trace) if p is not None])
    if png is not None:
        _need_matplotlib()
    run = load_timeline(args.log, require_steps=False)
    if not run.steps and not args.allow_empty:
        raise no_steps_error(run, "pass --allow-empty to draw it anyway")
    if png is not None:
        draw(run, png, title=args.title, dpi=args.dpi, until=args.until)
        print(f"Picture: {png}")
    if args.trace is not None:
        write_trace(run, args.trace)
        print(f"Trace: {args.trace} (open at https://ui.perfetto.dev)")


def _check_outputs(log: Path, outputs: list[Path]) -> None:
    where = os.path.realpath  # symlinks followed; a loop does not raise
    for path in outputs:
        if path.is_dir():
            raise TimelineError(f"{path}: is a directory; name the file to write")
        if not path.parent.is_dir():
            raise TimelineError(f"{path}: no such directory {path.parent}")
        if not os.access(path.parent, os.W_OK):
            raise TimelineError(f"{path}: cannot write in {path.parent} (permission denied)")
        if where(path) == where(log):
            raise TimelineError(f"{path}: is the log itself; name another file to write")
    if len(outputs) == 2 and where(outputs[0]) == where(outputs[1]):
        raise TimelineError(f"{outputs[0]}: --png and --trace name the same file")


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401 (only whether it imports)
    except ImportError:
        raise TimelineError(
            "drawing the picture needs matplotlib: pip install 'art-trio[plot]' "
            "(--trace FILE alone writes the Perfetto trace without it)"
        ) from None
