"""Hypothesis profiles for the property suite.

- `ci` (default): few examples per property, derandomized (every run explores the same
  examples, so CI is reproducible), no shrinking (a failure is reported at once, with its
  reproduction blob), no deadline (a run's wall time is not what we test), no example
  database (mutation tests must not seed the real properties' examples).
- `thorough`: many more random examples; print the seed and reproduction blob on failure.
- `dev`: the CI budget, but random, to look around a little on every local run.

Select with HYPOTHESIS_PROFILE=thorough (or pytest's --hypothesis-profile=thorough).
"""

from __future__ import annotations

import os

# ART fetches a price table when imported unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

_COMMON = settings(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# CI does not shrink: a failure reports its raw example and reproduction blob at once
# instead of spending minutes minimizing it (rerun with `thorough` or `dev` to minimize).
settings.register_profile(
    "ci",
    _COMMON,
    max_examples=40,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate, Phase.target),
)
settings.register_profile("dev", _COMMON, max_examples=40)
settings.register_profile("thorough", _COMMON, max_examples=400)
if "HYPOTHESIS_PROFILE" in os.environ:
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
elif settings.get_current_profile_name() == "default":
    # Not chosen on the command line (--hypothesis-profile is applied before this file).
    settings.load_profile("ci")


# -- warnings the harness provokes on purpose -------------------------------------------------

import re  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

#: The trainer's warnings about groups with no trajectories. The strategies draw such groups
#: on purpose (a rollout that returns nothing is one of the faults explored), so here each is
#: the expected answer to the case, checked below, not a problem to show after the run.
EXPECTED_WARNINGS = re.compile(
    r"rollout_fn returned an art\.TrajectoryGroup with no trajectories for scenario index \d+"
    r"|no step was trained: all \d+ groups rollout_fn returned had no trajectories"
    # Drawn on purpose too (the token faults): a trajectory without a token count.
    r"|a trajectory has no positive `completion_tokens` metric"
    # And a planned reward list of one: a zero-variance group of a single trajectory.
    r"|rollout_fn returned an art\.TrajectoryGroup of one trajectory for scenario index \d+"
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        expected = issubclass(warning.category, RuntimeWarning) and EXPECTED_WARNINGS.match(
            str(warning.message)
        )
        if not expected:  # anything else is shown as pytest shows warnings
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
