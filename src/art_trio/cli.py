"""`art-trio`: the command line. Each subcommand lives with the code it runs.

    art-trio demo      a real RL run on the CPU (art_trio.demo)
    art-trio simulate  the scheduler in virtual time, to plan a run (art_trio.sim)
    art-trio bench     art_trio against ART's asyncio trainer (art_trio.bench)
    art-trio timeline  a recorded run drawn as a picture and a trace (art_trio.timeline)
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence

from art_trio import __version__

# ART fetches a model price table when imported unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

#: Modules that come with an extra, not with art_trio itself, and the extra that brings them.
EXTRAS = {"hypercorn": "demo", "starlette": "demo", "matplotlib": "plot"}

SUBCOMMANDS = {
    "demo": ("art_trio.demo.cli", "a real RL run on the CPU, through the same code as a GPU run"),
    "simulate": ("art_trio.sim.cli", "run the real scheduler in virtual time to plan a run"),
    "bench": ("art_trio.bench.runner", "measure art_trio against ART's asyncio trainer"),
    "timeline": ("art_trio.timeline.cli", "draw a recorded run (PNG) and write its Perfetto trace"),
}


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `minimum`, refused at parse time with the
    bound in the message (a bad count must not surface as a traceback minutes later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def number_in(
    low: float, high: float = math.inf, *, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (or (low, high] with `low_open`);
    nan and inf are refused, as no step size or fraction is either."""
    if high == math.inf:
        shown = f"{'>' if low_open else '>='} {low:g}"
    else:
        shown = f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and low <= value <= high) or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be a finite number {shown}, got {text}")
        return value

    return parse


def _usage() -> str:
    lines = ["usage: art-trio {" + ",".join(SUBCOMMANDS) + "} [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`art-trio COMMAND --help` lists a command's options."]
    lines += ["`art-trio --version` prints art_trio's version."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        print(f"art-trio {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"art-trio: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[command][0])
        return int(module.main(rest) or 0)
    except ModuleNotFoundError as missing:
        package = (missing.name or "").split(".")[0]
        extra = EXTRAS.get(package)
        if extra is None:
            raise
        extra = "demo" if command == "demo" else extra
        print(
            f"art-trio {command}: {package} is not installed; it comes with the "
            f"{extra!r} extra: pip install 'art-trio[{extra}]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
