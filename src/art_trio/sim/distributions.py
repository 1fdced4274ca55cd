"""Duration distributions: now `art_trio.testing.distributions`, shared with the property suite.

Kept here so that `art_trio.sim.distributions` (and pickles naming it) keep working; the
simulator builds on the testing kit, never the other way round.
"""

from art_trio.testing.distributions import (
    Constant,
    Empirical,
    Exponential,
    IndexedDraws,
    LatencyDist,
    LogNormal,
    describe_distribution,
    draws_for,
    parse_distribution,
    parse_seconds,
    read_seconds,
)

__all__ = [
    "Constant",
    "Empirical",
    "Exponential",
    "IndexedDraws",
    "LatencyDist",
    "LogNormal",
    "describe_distribution",
    "draws_for",
    "parse_distribution",
    "parse_seconds",
    "read_seconds",
]
